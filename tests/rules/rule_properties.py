"""Properties every sharding decision must have, checked on the op itself, independent of the rule.

* **Partial only through linear ops.** Where a rule keeps ``Partial`` on a mesh dim (the inputs it
  requires Partial there, the output Partial there), the op must be additive in those inputs with the
  others fixed: ``f(a1 + a2, b1 + b2, y) == f(a1, b1, y) + f(a2, b2, y)``, and its output must be
  floating or complex (a sum of integer or bool pieces is not the cast of a sum).
* **Shards survive local shapes.** An accepted ``Shard`` on a dim whose local piece is small (size 1
  on tp, where ``squeeze`` or a view would drop or merge it) must still run and reassemble to the op
  on full tensors (``rule_harness.check``).
"""

from __future__ import annotations

from typing import Any

import torch
from rule_harness import MESH, Sample, build_graph, check, combinations, preferred_specs, tensor_names, _substitute

from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.errors import HGraphError
from hgraph.passes.annotate import _decide
from hgraph.rules.base import CP, TP, RuleInput, spec_str
from hgraph.rules.mesh import ShardingOptions


def _decision(target: Any, sample: Sample, specs: dict):
    graph, placeholders, node, outputs = build_graph(target, sample)
    params = frozenset(sample.params)
    options = ShardingOptions(cp=MESH[CP], tp=MESH[TP], params=params, buffers=frozenset())
    rin = RuleInput(options, {p: specs[p.name] for p in placeholders if p.name not in params},
                    {p for p in placeholders if p.name in params})
    rin.node = node
    try:
        return _decide(node, rin), placeholders
    except HGraphError:
        return None, placeholders


def _outputs(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def partial_kept(target: Any, sample: Sample, limit: int = 24, seed: int = 0) -> int:
    """Check linearity for every decision among the spec ``combinations`` that keeps Partial;
    returns how many such decisions were checked (raises ``AssertionError`` on a nonlinear one)."""
    checked = 0
    tensors = _flat_tensors(sample)
    names = tensor_names(sample)
    for combo in combinations(sample, limit, seed, preferred_specs(target, sample)):
        decision, placeholders = _decision(target, sample, combo)
        if decision is None:
            continue
        outs = decision.output if decision.output and isinstance(decision.output[0], tuple) else [decision.output]
        for m in (CP, TP):
            kept = [i for i, p in enumerate(placeholders)
                    if isinstance(decision.inputs.get(p, combo.get(p.name, (Replicate(),) * 2))[m], Partial)]
            if not kept or not any(o is not None and isinstance(o[m], Partial) for o in outs):
                continue
            checked += 1
            label = f"{target} keeps Partial on mesh dim {m} for {', '.join(names[i] for i in kept)} ({spec_str(outs[0])})"
            g = torch.Generator().manual_seed(seed + checked)
            first = list(tensors)
            second = list(tensors)
            for i in kept:
                noise = torch.randn(tensors[i].shape, generator=g, dtype=tensors[i].dtype)
                first[i], second[i] = tensors[i] / 2 + noise, tensors[i] / 2 - noise
            whole = _apply(target, sample, tensors)
            halves = zip(_apply(target, sample, first), _apply(target, sample, second))
            for o, w, (a, b) in zip(outs, whole, halves):
                if o is None or not isinstance(o[m], Partial):
                    continue
                assert w.is_floating_point() or w.is_complex(), f"{label}: a Partial {w.dtype} output"
                torch.testing.assert_close(a + b, w, msg=lambda s: f"{label}: the op is not linear there: {s}")
    return checked


def _flat_tensors(sample: Sample) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    torch.fx.node.map_aggregate((sample.args, sample.kwargs), lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _apply(target: Any, sample: Sample, tensors: list[torch.Tensor]) -> list:
    args, kwargs = _substitute(sample, list(tensors))
    return _outputs(target(*args, **kwargs))


def small_shards(target: Any, sample: Sample) -> int:
    """Run every tp-only ``(R, S(d))`` spec of one data input at a time, for dims whose size tp
    divides but 2·cp may not (local pieces down to size 1); returns how many were accepted."""
    accepted = 0
    names = [n for n in tensor_names(sample) if n not in sample.params]
    tensors = dict(zip(tensor_names(sample), _flat_tensors(sample)))
    for name in names:
        t = tensors[name]
        for d in range(t.dim()):
            if t.shape[d] % MESH[TP]:
                continue
            specs = {n: (Replicate(), Replicate()) for n in names}
            specs[name] = (Replicate(), Shard(d))
            accepted += check(target, sample, specs)
    return accepted
