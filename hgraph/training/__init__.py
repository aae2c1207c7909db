"""Training a compiled model: ``Trainer`` (``trainer.py``) with its options as values (``configs.py``:
``AdamWConfig``, ``RunConfig``, ``LRScheduleConfig``), ``export_pretrained`` (``export.py``) and the
``hgraph train`` config (``train_config.py``; its option tables, one per option type, ``config_sections.py``)."""
