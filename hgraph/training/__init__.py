"""Training a compiled model: ``Trainer`` (``trainer.py``) with its options as values (``configs.py``:
``AdamWConfig``, ``RunConfig``, ``LRScheduleConfig``), ``export_pretrained`` (``export.py``) and the
``hgraph train`` config (``train_config.py``; read, written and documented from its types by
``config_sections.py``, ``config_toml.py`` and ``config_reference.py``)."""
