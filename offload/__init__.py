"""offload: tables in page-locked host memory whose rows (and optimizer state) are switched onto the GPU.

Embedding tables, or B models' tables, plus their optimizer state can be far larger than GPU memory: only the
rows a step touches are moved. This package knows nothing of model batching and is useful on its own.

- :class:`HostTable`: a ``(rows, dim)`` table in pinned host memory; ``gather`` / ``scatter`` / ``prefetch``
  through a UVA zero-copy kernel or multi-threaded CPU indexing (``"auto"`` measures which is faster).
- :class:`OffloadedEmbedding` + :func:`attach`: a drop-in ``nn.Embedding`` trained by any elementwise
  torch optimizer, with a GPU cache of hot rows, prefetch and checkpoints.
- :class:`HostArray` + :func:`batches`: dataset rows gathered to GPU batches by index.
"""

from . import checkpoint_files
from ._cache_cuda import get_cache_kernels, set_cache_kernels, use_cache_kernels
from ._choice import engine_choice, get_engine, set_engine, use_engine
from ._embedding import OffloadedEmbedding, attach, detach
from ._host_array import HostArray, batches
from ._memory import HostMemoryError, host_memory_available
from ._optim import register_optimizer, row_state_spec
from ._prefetch import Prefetch
from ._table import HostTable
from ._uva import launch_counts as uva_launch_counts

__all__ = [
    "HostArray",
    "HostMemoryError",
    "HostTable",
    "OffloadedEmbedding",
    "Prefetch",
    "attach",
    "batches",
    "checkpoint_files",
    "detach",
    "engine_choice",
    "get_cache_kernels",
    "get_engine",
    "host_memory_available",
    "register_optimizer",
    "row_state_spec",
    "set_cache_kernels",
    "set_engine",
    "use_cache_kernels",
    "use_engine",
    "uva_launch_counts",
]
