"""torchmb in other training frameworks, each an optional extra imported only where it is used.

- :mod:`torchmb.integrations.lightning` (``pip install 'torchmb[lightning]'``): a ``LightningModule`` base
  class that clips, schedules and logs per model, and a learning-rate monitor with one column per model.
- :mod:`torchmb.integrations.transformers` (``pip install 'torchmb[transformers]'``): Hugging Face's
  ``Trainer`` training a ``BatchModule`` of a transformers model, with per-model loss, clipping,
  learning rates, schedules and logs.

Importing this package imports neither framework.
"""
