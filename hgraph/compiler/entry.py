"""``hgraph.compile``: check the options against the strategies, trace the model once, and build a ``CompiledModel``.

What is compiled and how is ``hgraph.compiler.compiled_model``; the options and their checks are
``hgraph.program.options``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch.distributed as dist
from torch import nn

from hgraph.compiler.build import gc_paused
from hgraph.compiler.compiled_model import COMPILE_LOCK, CompiledModel
from hgraph.core.model_info import model_dims
from hgraph.errors import InputError, StrategyError, TraceError
from hgraph.core.strategy import Pipeline, Strategy, as_strategies
from hgraph.frontend.capture import trace
from hgraph.frontend.router_loss import loss_for
from hgraph.program.options import CompileOptions


def compile(
    model: nn.Module,
    strategies: Union[Sequence[Union[Strategy, Pipeline, str]], Strategy, Pipeline, str],
    example_inputs: Any = None,
    *,
    loss_fn: Any = None,
    options: CompileOptions = CompileOptions(),
) -> CompiledModel:
    """Trace ``model`` once and compile it for every strategy (all must cover the same world size);
    one strategy alone (``"tp2 + 2x tp1"``, a ``Strategy``) is compiled as the only one.

    ``example_inputs``: ``input_ids`` ``[batch, seq]`` (or a tuple/dict with ``position_ids``,
    ``targets``). ``loss_fn``: the loss of the model's output (default: next-token cross entropy, with
    the MoE router auxiliary loss when the model's config asks for it). ``options``: a
    ``CompileOptions`` (precision, parallel settings, schedule, recompute, what is built, user passes;
    each field's docstring in ``hgraph.program.options``). ``compiled.packing`` says how documents are
    packed and why (``hgraph.compiler.packing_proof``); ``compiled.cache_hit`` whether the plans came
    from ``options.build.cache_dir``.
    """
    strategies = as_strategies(strategies)
    if not strategies:
        raise StrategyError("compile needs at least one strategy")
    if not isinstance(options, CompileOptions):
        raise InputError(f"compile(options={options!r}); expected a CompileOptions")
    world, dims = strategies[0].world_size, model_dims(model)
    for strategy in strategies:
        strategy.check(world, dims)
    options.check(strategies)
    if loss_fn is None:
        loss_fn = loss_for(model)  # with the MoE router auxiliary loss when the config asks for it
    # The user's model is traced as it is (fp32); a reduced compute_dtype is applied by the precision
    # pass as torch.autocast would apply it (hgraph.passes.precision).
    with COMPILE_LOCK:  # torch.export keeps global tracing state: one capture at a time per process
        with gc_paused():
            traced = trace(model, example_inputs, loss_fn, max_seq_len=options.max_seq_len)
        if not traced.dynamic:
            raise TraceError(
                f"cannot compile {type(model).__name__}: one traced graph must serve every micro-batch length, and "
                f"{traced.static_reason or 'export fixed its sizes'}; compute that value with tensor ops "
                "(torch.where, masks) instead of an `if` on the length — a maximum length (an assert, a sliced "
                "table) is fine, or give CompileOptions(max_seq_len=...)"
            )
        own = _own_rank(world) if options.build.rank == "auto" else options.build.rank
        return CompiledModel(model, traced, strategies, options, own)


def _own_rank(world: int) -> Optional[int]:
    """This process's rank in an initialised process group of ``world`` ranks (else ``None``)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
        return dist.get_rank()
    return None
