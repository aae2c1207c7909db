"""``hgraph.compile``: check the options, trace the model once, and build a ``CompiledModel``.

What is compiled and how is ``hgraph.compiler.compiled_model``; the options and their checks are
``hgraph.program.options``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from hgraph.compiler.build import gc_paused
from hgraph.compiler.compiled_model import COMPILE_LOCK, CompiledModel
from hgraph.core.errors import StrategyError, TraceError
from hgraph.core.model_info import model_dims
from hgraph.core.strategy import Pipeline, Strategy, as_strategies
from hgraph.frontend.capture import trace
from hgraph.frontend.router_loss import loss_for
from hgraph.lnk.topology import Topology
from hgraph.program.options import OverlapConfig, RecomputeConfig, compile_options


def compile(
    model: nn.Module,
    strategies: Sequence[Union[Strategy, Pipeline, str]],
    *,
    example_inputs: Any,
    loss_fn: Any = None,
    passes: Sequence[Any] = (),
    disable: Iterable[str] = (),
    compute_dtype: Optional[torch.dtype] = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = True,
    schedule: Union[str, OverlapConfig] = "none",
    layer_costs: Optional[Sequence[float]] = None,
    topology: Optional[Topology] = None,
    recompute: Union[str, RecomputeConfig, dict] = "none",
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    coalesce: bool = False,
    rank: Union[int, None, str] = "auto",
    verify: Optional[bool] = None,
    cache_dir: Optional[str] = None,
    pipeline_schedule: str = "1f1b",
    trust_shared_cache: bool = False,
    packing: str = "auto",
) -> CompiledModel:
    """Trace ``model`` once and compile it for every strategy (all must cover the same world size).

    ``example_inputs``: ``input_ids`` ``[batch, seq]`` (or a tuple/dict with ``position_ids``,
    ``targets``). ``passes``: user ``hgraph.Pass`` objects placed at named points (``after="localize"``).
    ``disable``: names of built-in passes to skip. ``compute_dtype``: mixed precision as ``torch.autocast``
    computes it (e.g. ``torch.bfloat16``: parameters pulled in bf16, halving Pull bytes; matmuls and
    attention in bf16; buffers, norms, softmax, rotary application and the loss in fp32; see
    ``hgraph.passes.precision``). ``layer_costs``: per-layer cost for balancing stages.
    ``schedule``: ``"none"`` (pull all, 1F1B, push all) or ``"overlap"`` / an
    ``hgraph.program.options.OverlapConfig`` (prefetched pulls, early pushes; same results).
    ``recompute``: ``"none"``, ``"selective"``, ``"full"`` or a ``RecomputeConfig`` choosing layers
    (``RecomputeConfig("full", every=2)``); see ``hgraph.passes.recompute``; or a dict from pipeline
    scheme (``"tp2,pp2"``) to one of those, e.g. the planner's ``choose_recompute`` per scheme. ``reduce_dtype``: dtype
    gradients are reduced in by Push Gradient (fp32 by default, also under a bf16 ``compute_dtype``;
    ``None`` reduces in the compute dtype). ``coalesce``: pull and push each layer's parameters
    together, one merged call per group and kind (``hgraph.runtime.kernels.coalesce``), so an iteration issues
    O(layers) collectives instead of O(parameters); ``schedule="none"`` only for now. ``rank``: the
    rank whose plans and programs are built now (``"auto"``: the process's own rank in an initialised
    process group of this world size, as under ``hgraph.launch`` / torchrun, else ``None``: every
    rank); any other rank's are built on first use and equal a full compile's. ``verify``: run the
    compile-time dry run of ``schedule="overlap"`` over every rank (default: world size <=
    ``VERIFY_WORLD``; it builds every rank's program). ``cache_dir`` (or ``$HGRAPH_COMPILE_CACHE``):
    keep the compiled rank's Pull / Push plans on disk, keyed by what they are built from
    (``hgraph.compiler.compile_cache``: JSON data, never code); ``compiled.cache_hit`` says whether they came
    from there. A cache directory that other users can write is refused unless
    ``trust_shared_cache=True`` (everyone who can write it is trusted; docs/reliability.md, "Trust").
    ``pipeline_schedule``: ``"1f1b"`` or ``"zb1p"`` (zero-bubble ZB-H1: each backward split into an
    input-gradient and a weight-gradient step, ``schedule="none"`` only); a pipeline with ``vpp > 1``
    (``"tp1,pp2,vpp2"``) runs interleaved 1F1B; see ``hgraph.schedule.lowerings``. ``packing``: ``"auto"``
    (several documents per micro-batch once packing is proved exact for this model, from the graph
    or by probing; else one document per micro-batch with a ``PackingWarning``), ``"require"``
    (an unproved model is a ``PackingError``) or ``"off"`` (one document per micro-batch);
    ``compiled.packing`` says which and why (``hgraph.compiler.packing_proof``).
    """
    strategies = as_strategies(strategies)
    if not strategies:
        raise StrategyError("compile needs at least one strategy")
    world, dims = strategies[0].world_size, model_dims(model)
    for strategy in strategies:
        strategy.check(world, dims)
    if loss_fn is None:
        loss_fn = loss_for(model)  # with the MoE router auxiliary loss when the config asks for it
    options = compile_options(
        strategies, compute_dtype=compute_dtype, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
        schedule=schedule, layer_costs=layer_costs, topology=topology, recompute=recompute,
        reduce_dtype=reduce_dtype, coalesce=coalesce, pipeline_schedule=pipeline_schedule,
    )
    # The user's model is traced as it is (fp32); a reduced compute_dtype is applied by the precision
    # pass as torch.autocast would apply it (hgraph.passes.precision).
    with COMPILE_LOCK:  # torch.export keeps global tracing state: one capture at a time per process
        with gc_paused():
            traced = trace(model, example_inputs, loss_fn)
        if not traced.dynamic:
            raise TraceError(
                f"cannot compile {type(model).__name__}: one traced graph must serve every micro-batch shape, and "
                f"this model specialises on its input shape — {traced.static_reason or 'export fixed its sizes'}; "
                "write that computation without Python control flow over sizes (or supply a layer that does)"
            )
        own = _own_rank(world) if rank == "auto" else rank
        return CompiledModel(model, traced, strategies, options, passes, disable, own, verify, cache_dir,
                             trust_shared_cache=trust_shared_cache, packing=packing)


def _own_rank(world: int) -> Optional[int]:
    """This process's rank in an initialised process group of ``world`` ranks (else ``None``)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
        return dist.get_rank()
    return None
