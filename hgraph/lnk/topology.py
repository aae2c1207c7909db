"""Where ranks sit and how fast they talk: the alpha-beta model behind plan predictions and sender choice.

Ranks ``0..ranks_per_node-1`` share node 0, the next ``ranks_per_node`` node 1, and so on. A message of
``b`` bytes between two ranks costs ``latency + b / bandwidth`` of the link they share (intra-node:
NVLink class, inter-node: InfiniBand class by default).
"""

from __future__ import annotations

from dataclasses import dataclass

from hgraph.errors import LayoutError


@dataclass(frozen=True)
class Topology:
    """Ranks per node and the bandwidth (bytes/s) and latency (s) of intra- and inter-node links."""

    ranks_per_node: int = 8
    intra_bandwidth: float = 150e9
    intra_latency: float = 3e-6
    inter_bandwidth: float = 25e9
    inter_latency: float = 10e-6

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise LayoutError(f"ranks_per_node={self.ranks_per_node}; it must be >= 1")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name}={getattr(self, name)}; bandwidths must be > 0 bytes/s")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                raise LayoutError(f"{name}={getattr(self, name)}; latencies must be >= 0 s")

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    def link(self, a: int, b: int) -> tuple[float, float]:
        """``(latency, bandwidth)`` of the link between ranks ``a`` and ``b``."""
        if self.same_node(a, b):
            return self.intra_latency, self.intra_bandwidth
        return self.inter_latency, self.inter_bandwidth

    def message_time(self, a: int, b: int, nbytes: int) -> float:
        latency, bandwidth = self.link(a, b)
        return latency + nbytes / bandwidth

    def __str__(self) -> str:
        return (
            f"Topology({self.ranks_per_node}/node, intra {self.intra_bandwidth / 1e9:g} GB/s "
            f"{self.intra_latency * 1e6:g}us, inter {self.inter_bandwidth / 1e9:g} GB/s "
            f"{self.inter_latency * 1e6:g}us)"
        )


DEFAULT_TOPOLOGY = Topology()
