"""What compiled programs and reshard plans execute with: communicators (``comm.py``), the custom ops
(``collectives.py``, ``vocab_parallel.py``, ``packed_attention.py``), the reshard interpreter
(``reshard.py``, ``coalesce.py``, ``simulate.py``), recompute regions and failure reports. Passes
insert calls to these ops."""
