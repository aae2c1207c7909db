"""The compiler: ``compile`` and ``CompiledModel`` (``compiled_model.py``), the on-disk plan cache
(``compile_cache.py``) and printing (``show.py``). ``hgraph.compile`` is the public entry point."""
