"""Compile products, read by the passes and the runtime: the options of ``compile`` (``options.py``), the
context a pass sees (``context.py``), stage graphs, communication subgraphs and the overlap order
(``products.py``), and the rank program with the ``CompiledPrograms`` protocol (``rank_program.py``)."""
