"""Planner: cost model, MaxLen, strategy proposal, per-iteration assignment, simulation."""

from hgraph.planner.analytic import HardwareSpec, ModelConfig, analytic_cost_model
from hgraph.planner.cost import CostModel, StageCost, load_cost_model
from hgraph.planner.fit import Fit, fit_stage_cost
from hgraph.planner.memory import MemoryRegression
from hgraph.planner.proposal import Candidate, propose, propose_candidates

__all__ = [
    "Candidate", "CostModel", "Fit", "HardwareSpec", "MemoryRegression", "ModelConfig", "StageCost",
    "analytic_cost_model", "fit_stage_cost", "load_cost_model", "propose", "propose_candidates",
]

from hgraph.planner.assign import Planner, plan_iteration
from hgraph.planner.baselines import HydraulisReference, homogeneous_tuned, hydraulis_reference, megatron
from hgraph.planner.batches import make_batches, read_lengths, sample_path
from hgraph.planner.plan import IterationPlan, PipelinePlan
from hgraph.planner.timing import AlphaBetaComm, CommModel, PipelineCost, predict

__all__ += [
    "AlphaBetaComm", "CommModel", "HydraulisReference", "IterationPlan", "PipelineCost", "PipelinePlan", "Planner",
    "homogeneous_tuned", "hydraulis_reference", "make_batches", "megatron", "plan_iteration", "predict",
    "read_lengths", "sample_path",
]

from hgraph.planner.bound import LowerBound, lower_bound
from hgraph.planner.context import with_context_parallel

__all__ += ["LowerBound", "lower_bound", "with_context_parallel"]
