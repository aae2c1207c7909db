"""Training a compiled model: ``Trainer`` (``trainer.py``), ``export_pretrained`` (``export.py``) and the
``hgraph train`` config (``train_config.py``)."""
