"""hgraph.runtime: executes compiled programs and reshard plans on real or simulated ranks.

``execute(plan, local)`` runs a ``hgraph.lnk.ReshardPlan`` on the calling rank; ``launch`` spawns
local ranks; ``Trainer`` (also ``hgraph.Trainer``) trains a compiled model.
"""

from hgraph.runtime.launch import init_from_env, launch
from hgraph.runtime.reshard import execute

__all__ = ["execute", "init_from_env", "launch"]
