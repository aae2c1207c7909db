"""Compile products: options, the compile context, stage graphs, parameter layouts and plans, rank
programs and the ``CompiledPrograms`` protocol (``products.py``). Read by the passes and the runtime."""
