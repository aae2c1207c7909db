"""LNK: plan and simulate changes of layout (resharding) between any two layouts or unions."""

from hgraph.lnk.pieces import Piece, assemble, is_partial, local_shards, pieces_of
from hgraph.lnk.plan import AllGather, AllReduce, AllToAll, LocalCopy, ReduceScatter, ReshardPlan, Step, Transfer
from hgraph.lnk.rank_plan import RankPlan, solve_rank
from hgraph.lnk.simulate import simulate
from hgraph.lnk.solver import solve
from hgraph.lnk.topology import DEFAULT_TOPOLOGY, Topology

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "DEFAULT_TOPOLOGY", "LocalCopy", "Piece", "ReduceScatter",
    "RankPlan", "ReshardPlan", "Step", "Topology", "Transfer", "assemble", "is_partial", "local_shards", "pieces_of", "simulate",
    "solve", "solve_rank",
]
