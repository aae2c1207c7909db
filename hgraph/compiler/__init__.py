"""The compiler: ``compile`` (``entry.py``) makes a ``CompiledModel`` (``compiled_model.py``: lookups),
whose products the compile walk (``build.py``) computes in order: the passes, parameter planning
(``parameter_plans.py``), the overlap order (``overlap_order.py``); then the dry run of every rank's
actions (``verify.py``); the on-disk plan cache (``compile_cache.py``) and inspection (``show.py``).
``hgraph.compile`` is the public entry point."""
