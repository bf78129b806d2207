import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Inductor's on-disk caches outlive a run (/tmp/torchinductor_<user>): artifacts compiled by another checkout
# of this code, with other batched layers, were seen to be reused here and to train LeNet wrongly. Each run
# compiles afresh in a directory of its own (set before torch compiles anything).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchmb-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _exact_float32_matmul():
    """Tests compare against plain torch at fp32 tolerances: keep TF32 off on GPUs."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
