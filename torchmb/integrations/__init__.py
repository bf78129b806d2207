"""torchmb in other training frameworks, each an optional extra imported only where it is used.

- :mod:`torchmb.integrations.lightning` (``pip install 'torchmb[lightning]'``): a ``LightningModule`` base
  class that clips, schedules and logs per model, and a learning-rate monitor with one column per model.
- :mod:`torchmb.integrations.transformers` (``pip install 'torchmb[transformers]'``): Hugging Face's
  ``Trainer`` training a ``BatchModule`` of a transformers model, with per-model loss, clipping,
  learning rates, schedules and logs.

Importing this package imports neither framework. Both import torchvision where it is installed; where
its compiled operators cannot load beside this torch (PyPI's wheel beside a CPU torch), this package declares
them without kernels first, so that the frameworks import (:mod:`torchmb.integrations._torchvision`).
"""

from ._torchvision import declare_unloadable_torchvision_ops

declare_unloadable_torchvision_ops()
