"""Samples for the rule harness drawn from PyTorch's own OpInfo database (``op_db``), as DTensor's
``test_dtensor_ops.py`` draws them.

For one ``op_db`` entry, every sample (fp64, CPU) is traced with ``make_fx(pre_dispatch=True)`` — the
ATen level hgraph compiles — and the trace is run once with an interpreter that records every call of
an op with a sharding rule together with its real inputs. Each recorded call becomes a
``rule_harness.Sample``. A second, *scaled* copy of every sample has each tensor input of more than
one element tiled four times along every dim of size > 1, so that the dims divide the 2x2 mesh (and
cp's 2·cp load-balanced chunks) and sharded placements are exercised, not only replicated ones; a
scaled sample the op itself rejects is dropped (its shape arguments no longer fit).

The oracle stays independent of the rules: ``rule_harness.check`` cuts the inputs and reassembles the
outputs by hand and compares with the op on full tensors.
"""

from __future__ import annotations

import functools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx as fx
from rule_harness import Sample, check, combinations, preferred_specs
from torch.fx.experimental.proxy_tensor import make_fx

from hgraph.core.placement import Replicate
from hgraph.errors import HGraphError
from hgraph.rules import lookup
from hgraph.rules.base import spec_str

TILE = 4  # each dim of size > 1 of a scaled sample: 4x (the 2x2 mesh, cp's 4 token chunks)
MAX_SCALED = 1 << 18  # elements of a scaled tensor; a sample with a larger one is checked as given only
SKIPPED_NODES = {operator.getitem}  # recorded through their producer (the harness adds them)


@functools.lru_cache(maxsize=1)
def entries() -> dict[str, Any]:
    """``op_db`` entries that run on CPU in fp64 (or, integer and bool ops, int64 / bool), by
    ``name.variant``, with that dtype."""
    from torch.testing._internal.common_methods_invocations import op_db  # needs expecttest

    found = {}
    for info in op_db:
        dtype = next((d for d in DTYPES if d in info.supported_dtypes("cpu")), None)
        key = f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name
        if dtype is not None:
            found.setdefault(key, (info, dtype))
    return found


DTYPES = (torch.float64, torch.int64, torch.bool)  # the first an entry supports


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def _tile(t: torch.Tensor) -> torch.Tensor:
    """``t`` tiled; floating values moved by a relative 1e-4 (and 1e-6) so that the copies are not exact ties
    (ties make max/sort/topk indices and gradients depend on last-bit rounding of Partial pieces)."""
    if t.numel() <= 1 or t.layout != torch.strided:
        return t
    tiled = t.repeat(tuple(TILE if n > 1 else 1 for n in t.shape))
    if tiled.is_floating_point():
        g = torch.Generator().manual_seed(tiled.numel())
        noise = lambda: 2 * torch.rand(tiled.shape, generator=g, dtype=tiled.dtype) - 1  # noqa: E731
        tiled = tiled * (1 + 1e-4 * noise()) + 1e-6 * noise()  # zeros too
    return tiled


class _Recorder(fx.Interpreter):
    """Runs a trace and keeps ``(target, args, kwargs)`` of every call of an op with a rule."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.calls: list[tuple[Any, tuple, dict]] = []

    def call_function(self, target, args, kwargs):
        if target not in SKIPPED_NODES and lookup(target) is not None:
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.calls.append((target, fx.node.map_aggregate(args, clone), fx.node.map_aggregate(kwargs, clone)))
        return super().call_function(target, args, kwargs)


def _trace_calls(info: Any, args: tuple, kwargs: dict) -> list[tuple[Any, tuple, dict]]:
    """Every call of an op with a rule in the pre-dispatch trace of ``info.op(*args, **kwargs)``."""
    leaves = _tensor_leaves((args, kwargs))

    def fn(*tensors):
        it = iter(tensors)
        swap = lambda v: next(it) if isinstance(v, torch.Tensor) else v  # noqa: E731
        a, k = fx.node.map_aggregate(args, swap), fx.node.map_aggregate(kwargs, swap)
        return info.op(*a, **k)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = make_fx(fn, pre_dispatch=True)(*leaves)
        recorder = _Recorder(gm)
        recorder.run(*[t.clone() for t in leaves])
    return recorder.calls


def _sample_args(s: Any) -> tuple[tuple, dict]:
    return (s.input, *s.args), dict(s.kwargs)


def calls(key: str, max_samples: int | None = None) -> Iterator[tuple[str, Any, Sample]]:
    """``(label, target, Sample)`` for every call of an op with a rule that the entry's samples reach:
    each sample as ``op_db`` gives it and scaled. Samples that cannot be traced (data-dependent
    shapes, ops make_fx refuses) are passed over; ``max_samples`` keeps the first few."""
    info, dtype = entries()[key]
    samples = info.sample_inputs("cpu", dtype, requires_grad=False)
    for i, s in enumerate(samples):
        if max_samples is not None and i >= max_samples:
            return
        args, kwargs = _sample_args(s)
        if any(t.layout != torch.strided for t in _tensor_leaves((args, kwargs))):
            continue  # sparse and nested tensors: hgraph traces dense models
        variants = [("", (args, kwargs))]
        if all(t.numel() * TILE ** sum(n > 1 for n in t.shape) <= MAX_SCALED for t in _tensor_leaves((args, kwargs))):
            variants.append((" scaled", fx.node.map_aggregate((args, kwargs), lambda v: _tile(v) if isinstance(v, torch.Tensor) else v)))
        for variant, (a, k) in variants:
            try:
                recorded = _trace_calls(info, a, k)
            except Exception:  # noqa: BLE001 - the op itself rejects it, or make_fx cannot trace it
                continue
            for j, (target, cargs, ckwargs) in enumerate(recorded):
                yield f"{key} sample {i}{variant} call {j}", target, Sample(cargs, ckwargs)


def _flags(target: Any) -> dict:
    """``Sample`` flags the op's schema implies: random and ``empty`` outputs have only shapes and
    dtypes to compare; an op that writes its first input runs forward only."""
    if not isinstance(target, torch._ops.OpOverload):
        return {}
    random = torch.Tag.nondeterministic_seeded in target.tags or "empty" in target.__name__
    args = target._schema.arguments
    inplace = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    return {"values": not random, "inplace": inplace}


def _differentiable(target: Any, sample: Sample) -> bool:
    """Whether autograd has a derivative for the op on these inputs (``floor_divide`` has none)."""
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in _tensor_leaves((sample.args, sample.kwargs))]
    if not any(t.requires_grad for t in leaves):
        return True
    it = iter(leaves)
    swap = lambda v: next(it) if isinstance(v, torch.Tensor) else v  # noqa: E731
    try:
        out = target(*fx.node.map_aggregate(sample.args, swap), **fx.node.map_aggregate(sample.kwargs, swap))
        outs = [o for o in _tensor_leaves(out) if o.requires_grad]
        if outs:
            torch.autograd.grad(sum(o.sum().real if o.is_complex() else o.sum() for o in outs), [t for t in leaves if t.requires_grad], allow_unused=True)
    except RuntimeError as e:
        return "derivative" not in str(e) and "not implemented" not in str(e)
    return True


def _nonreplicated(combo: dict) -> bool:
    return any(not all(isinstance(p, Replicate) for p in spec) for spec in combo.values())


def check_entry(key: str, max_samples: int | None, limit: int, seed: int = 0) -> EntryReport:
    """Every accepted spec combination (up to ``limit`` per call) of every call the entry's samples
    reach, through ``rule_harness.check``: a wrong result (``AssertionError``) and any exception other
    than an ``HGraphError`` are collected, not raised, so one report lists them all."""
    report = EntryReport(key)
    drawn = 0
    for label, target, sample in calls(key, max_samples):
        flags = _flags(target)
        if not flags.get("inplace"):
            flags["differentiable"] = _differentiable(target, sample)
        sample = Sample(sample.args, sample.kwargs, **flags)
        report.calls += 1
        report.ops.add(str(target))
        try:
            combos = combinations(sample, limit, seed, preferred_specs(target, sample))
        except HGraphError:
            continue
        except Exception as e:  # noqa: BLE001 - the rule crashed deciding on replicated inputs
            report.crashes.append(f"{label}: {target} on replicated inputs: {type(e).__name__}: {str(e)[:300]}")
            continue
        for combo in combos:
            what = f"{label}: {target} with {', '.join(f'{k}={spec_str(v)}' for k, v in combo.items())}"
            drawn += 1  # each combination its own Partial terms and cotangents: more values per sample
            try:
                accepted = check(target, sample, combo, seed + drawn)
            except HGraphError:
                accepted = False
            except AssertionError as e:
                report.wrong.append(f"{what}: {str(e).splitlines()[0][:300]}")
                continue
            except Exception as e:  # noqa: BLE001 - a crash is what the suite reports
                report.crashes.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                continue
            if accepted:
                report.checked += 1
                report.sharded += _nonreplicated(combo)
            else:
                report.refused += 1
    return report


@dataclass
class EntryReport:
    """What ``check_entry`` found for one ``op_db`` entry."""

    key: str
    calls: int = 0
    checked: int = 0  # accepted decisions run and compared
    sharded: int = 0  # of those, with a non-replicated input
    refused: int = 0  # refused with an HGraphError
    ops: set = field(default_factory=set)
    wrong: list = field(default_factory=list)
    crashes: list = field(default_factory=list)


def _rule_name(target: Any) -> str:
    """The registered name of the rule ``lookup`` finds for ``target`` (an overload's own first)."""
    from hgraph.rules import registered_ops
    from hgraph.rules.base import op_name

    if isinstance(target, torch._ops.OpOverload):
        return str(target) if str(target) in registered_ops() else str(target.overloadpacket)
    return op_name(target)


def main() -> None:
    """Print which registered rules the entries' first samples reach and which they do not."""
    import json

    from hgraph.rules import registered_ops

    reached = {_rule_name(t) for key in sorted(entries()) for _, t, _ in calls(key, 1)}
    rules = set(registered_ops())
    print(json.dumps({"rules": len(rules), "reached_by_op_db": len(rules & reached),
                      "checked_by_rule_cases_only": sorted(rules - reached)}, indent=1))


if __name__ == "__main__":
    main()
