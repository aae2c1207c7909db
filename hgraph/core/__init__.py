"""Core types every layer uses: layouts, strategies, the ZeRO layout, seeding, packed
micro-batches and what is read from a user's model. Imports only ``hgraph.errors`` of hgraph."""
