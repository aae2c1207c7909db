"""hgraph.runtime: executes compiled programs and reshard plans on real or simulated ranks.

``execute(plan, local, comm)`` runs a ``hgraph.lnk.ReshardPlan`` on the calling rank (``comm``: a
``hgraph.runtime.kernels.comm.ProcessGroupComm`` in launched processes); ``launch`` spawns
local ranks; ``Trainer`` (also ``hgraph.Trainer``) trains a compiled model.
"""

from hgraph.runtime.kernels.reshard import execute
from hgraph.runtime.launch import init_from_env, launch

__all__ = ["execute", "init_from_env", "launch"]
