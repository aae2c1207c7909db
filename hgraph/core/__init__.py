"""Core types every layer uses: errors, layouts, strategies, the ZeRO layout, seeding, packed
micro-batches and what is read from a user's model. Imports nothing else of hgraph."""
