"""The compiler: ``compile`` (``entry.py``) builds a ``CompiledModel`` (``compiled_model.py``), which
runs the passes and the compile steps: parameter planning (``parameter_plans.py``), the overlap order
(``overlap_order.py``), the dry run of every rank's actions (``verify.py``); the on-disk plan cache
(``compile_cache.py``) and inspection (``show.py``). ``hgraph.compile`` is the public entry point."""
