"""Check one sharding rule the OpInfo way: localize one op for given input specs on a ``(cp, tp)``
mesh, run it on simulated ranks and compare forward and vjp with the single-device op.

For a sample (full fp64 inputs) and one spec per non-parameter input, the harness builds the global
graph ``placeholders -> op [-> getitem...] -> output``, asks the op's registered rule for its
decision (parameters are free: the rule places them, as in ``annotate``), records the partial-
gradient uses exactly as ``annotate`` does, localizes with ``hgraph.passes.localize`` and runs the
local program on 4 ranks (threads, real collectives of ``hgraph.runtime.kernels.collectives``):

* inputs: Shard pieces (cp token dims in the load-balanced order), Replicate copies, Partial terms
  that differ per rank and sum to the value;
* forward: every output is reassembled from the ranks by its output spec (Partial summed, Shard
  concatenated, Replicate checked equal on all ranks) and compared with the op on full inputs;
* backward: a random cotangent, cut by the output spec, is back-propagated on every rank; each
  input's gradient is reassembled by the input's spec (a Replicate/Partial input must receive the
  whole, exact gradient on every rank, a replicated parameter may receive a Partial one that Push
  Gradient sums) and compared with ``torch.autograd.grad`` of the op.

A rule that refuses a spec with an ``HGraphError`` (localize refusing a layout change it has no plan for included) is not
a failure: the spec is counted as refused. Any other exception is.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from hgraph.errors import HGraphError
from hgraph.core.placement import InterleavedShard, Partial, Replicate, Shard, StridedShard
from hgraph.passes.annotate import _decide, _partial_uses
from hgraph.passes.bind_rank import bind_rank
from hgraph.passes.localize import localize
from hgraph.rules import lookup
from hgraph.rules.base import CP, RuleInput, Spec, spec_str, TP
from hgraph.rules.mesh import ShardingOptions
from hgraph.rules.sharding_utils import mesh_coord, mesh_groups
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.kernels.context import RankContext
from hgraph.core.batch import load_balance_indices

MESH = (2, 2)
WORLD = MESH[CP] * MESH[TP]
COORDS = [mesh_coord(r, MESH) for r in range(WORLD)]


def _set_mesh(mesh: tuple[int, int]) -> None:
    """The mesh of the case being checked (2x2, or 1x2 for ops refused on any cp)."""
    global MESH, WORLD, COORDS
    MESH, WORLD = mesh, mesh[CP] * mesh[TP]
    COORDS = [mesh_coord(r, MESH) for r in range(WORLD)]


@dataclass(frozen=True)
class Sample:
    """One call of the op: ``args``/``kwargs`` with full tensors; ``params``: names of the tensor
    arguments that are model parameters (placed by the rule), ``names``: placeholder name per tensor
    argument in order (default ``x0, x1, ...``; ``position_ids`` matters to some rules)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    names: tuple[str, ...] = ()
    params: frozenset[str] = frozenset()
    values: bool = True  # False: only shapes and dtypes are defined (``empty``)
    inplace: bool = False  # mutates its first input: forward only (autograd refuses in-place on leaves)
    differentiable: bool = True  # False: the op has no derivative (floor_divide): forward only

    @property
    def forward_only(self) -> bool:
        return self.inplace or not self.differentiable


@dataclass
class Outcome:
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def _inexact(t: torch.Tensor) -> bool:
    """Floating or complex: values that have gradients and may be Partial."""
    return t.is_floating_point() or t.is_complex()


# --------------------------------------------------------------------------- cutting and assembling
def _token_cut(t: torch.Tensor, dim: int, index: int, degree: int) -> torch.Tensor:
    return t.index_select(dim, load_balance_indices(t.shape[dim], degree, index))


def cut(full: torch.Tensor, spec: Spec, coord: tuple[int, int], token_order: bool) -> torch.Tensor:
    """The piece of ``full`` at ``coord`` (Partial dims ignored: every rank sees the whole)."""
    out = full
    for m, p in enumerate(spec):
        if not isinstance(p, Shard):
            continue
        dim = p.dim % out.dim()
        if isinstance(p, InterleavedShard):
            blocks = out.split(list(p.blocks), dim)
            out = torch.cat([b.chunk(MESH[m], dim)[coord[m]] for b in blocks], dim)
        elif isinstance(p, StridedShard):
            shape = list(out.shape)
            out = out.unflatten(dim, (p.split_factor, shape[dim] // p.split_factor))
            out = (_token_cut(out, dim + 1, coord[m], MESH[m]) if m == CP and token_order else out.chunk(MESH[m], dim + 1)[coord[m]])
            out = out.flatten(dim, dim + 1)
        elif m == CP and token_order:
            out = _token_cut(out, dim, coord[m], MESH[m])
        else:
            out = out.chunk(MESH[m], dim)[coord[m]]
    return out


def assemble(pieces: Sequence[torch.Tensor], shape: Sequence[int], spec: Spec, token_order: bool,
             sum_dims: Sequence[int] = (), what: str = "") -> torch.Tensor:
    """The full tensor from every rank's piece. Mesh dims in ``sum_dims`` are summed (Partial), other
    non-Shard mesh dims must hold equal pieces."""
    index = torch.arange(int(torch.tensor(shape).prod())).reshape(tuple(shape))
    full = None
    counts = None
    for rank, coord in enumerate(COORDS):
        piece = pieces[rank]
        where = cut(index, spec, coord, token_order)
        assert tuple(piece.shape) == tuple(where.shape), f"{what}: rank {rank} holds {tuple(piece.shape)}, spec {spec_str(spec)} gives {tuple(where.shape)}"
        if full is None:
            full = torch.zeros(index.numel(), dtype=piece.dtype)
            counts = torch.zeros(index.numel(), dtype=torch.long)
        summed = all(c == 0 for m, c in enumerate(coord) if m not in sum_dims and not isinstance(spec[m], Shard))
        if summed:
            full.index_add_(0, where.flatten(), piece.flatten().to(full.dtype)) if _inexact(full) else full.index_put_((where.flatten(),), piece.flatten(), accumulate=True)
            counts.index_add_(0, where.flatten(), torch.ones(where.numel(), dtype=torch.long))
    for a, b in itertools.combinations(range(WORLD), 2):
        ca, cb = COORDS[a], COORDS[b]
        differ = [m for m in range(2) if ca[m] != cb[m]]
        if all(not isinstance(spec[m], Shard) and m not in sum_dims for m in differ):
            torch.testing.assert_close(pieces[a], pieces[b], equal_nan=True, msg=lambda s, a=a, b=b: f"{what}: ranks {a} and {b} should hold the same value under {spec_str(spec)}: {s}")
    assert counts is not None and full is not None
    expected = 1
    for m in sum_dims:
        expected *= MESH[m]
    assert bool((counts == expected).all()), f"{what}: spec {spec_str(spec)} does not cover every element exactly once"
    return full.reshape(tuple(shape))


SPARE_BITS = 5  # below a float's mantissa: room for up to 4 terms of up to 4x the value, summed in any order


def on_grid(full: torch.Tensor) -> torch.Tensor:
    """``full`` rounded to a grid of ``2**(e - mantissa bits + SPARE_BITS)`` (``2**e`` above every finite
    ``|value|``), so that Partial terms drawn on the same grid sum to it exactly in any order and
    grouping: the reduction the runtime does then adds no rounding of its own, and the oracle sees
    the very value the ranks sum to (kinks such as ``abs`` at 0 and exact ties stay where they are)."""
    if not _inexact(full):
        return full
    real = torch.view_as_real(full) if full.is_complex() else full
    finite = real[torch.isfinite(real)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    if top == 0.0:
        return full
    grid = _grid(real.dtype, top)
    if grid == 0.0:
        return full
    rounded = torch.where(torch.isfinite(real), torch.round(real / grid) * grid, real)
    return torch.view_as_complex(rounded) if full.is_complex() else rounded


def _grid(dtype: torch.dtype, top: float) -> float:
    info = torch.finfo(dtype)
    e = math.frexp(top)[1]  # top < 2**e
    mantissa_bits = 1 - math.frexp(info.eps)[1]  # eps == 2**-mantissa_bits
    grid = math.ldexp(1.0, e - mantissa_bits + SPARE_BITS)
    return grid if grid >= info.tiny else 0.0


def partial_terms(full: torch.Tensor, spec: Spec, token_order: bool, rng: torch.Generator) -> list[torch.Tensor]:
    """Every rank's local value: its cut, split into per-rank terms along the Partial mesh dims. Each
    term but the last of a group is noise of the value's scale (1 for an all-zero value) on
    ``on_grid``'s grid, the last is the rest; for ``full`` on that grid the terms sum to it exactly."""
    pdims = [m for m, p in enumerate(spec) if isinstance(p, Partial)]
    base = [cut(full, spec, c, token_order) for c in COORDS]
    if not pdims or not _inexact(full):
        return [b.clone() for b in base]
    real = torch.view_as_real(full) if full.is_complex() else full
    finite = real[torch.isfinite(real)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    top = top or 1.0  # all zero: terms of unit scale on its grid still cancel exactly
    grid = _grid(real.dtype, top)
    scale = math.ldexp(1.0, math.frexp(top)[1])
    bound = min(4.0, torch.finfo(real.dtype).max / (16 * scale))  # noise up to 4x the value, kept finite
    # a replicated mesh dim must see equal terms: the noise depends on the Shard and Partial coords only
    key = [tuple(c[m] if not isinstance(spec[m], Replicate) else 0 for m in range(2)) for c in COORDS]

    def noise(shape: torch.Size) -> torch.Tensor:
        n = torch.randn(tuple(shape) + ((2,) if full.is_complex() else ()), generator=rng, dtype=torch.float64)
        n = n.clamp(-bound, bound) * scale
        n = (torch.round(n / grid) * grid if grid else n).to(real.dtype)
        return torch.view_as_complex(n) if full.is_complex() else n

    table = {kk: noise(base[key.index(kk)].shape) for kk in sorted(set(key))}
    out = []
    for rank, coord in enumerate(COORDS):
        group = [r for r, c in enumerate(COORDS) if all(c[m] == coord[m] for m in range(2) if m not in pdims)]
        last = max(key[r] for r in group)
        if key[rank] != last:
            out.append(table[key[rank]].clone())
        else:
            others = {key[r] for r in group if key[r] != last}
            out.append(base[rank] - sum((table[kk] for kk in sorted(others)), torch.zeros_like(base[rank])))
    return out


# --------------------------------------------------------------------------- graph building
def _tensors(sample: Sample) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate((sample.args, sample.kwargs), lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def tensor_names(sample: Sample) -> list[str]:
    n = len(_tensors(sample))
    return list(sample.names) if sample.names else [f"x{i}" for i in range(n)]


def build_graph(target: Any, sample: Sample) -> tuple[fx.Graph, list[fx.Node], fx.Node, list[fx.Node]]:
    """``placeholders -> op -> output`` with real values in ``meta['val']`` (static shapes)."""
    graph = fx.Graph()
    names = iter(tensor_names(sample))
    placeholders: list[fx.Node] = []

    def place(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            node = graph.placeholder(next(names))
            node.meta["val"] = v
            placeholders.append(node)
            return node
        return v

    args = fx.node.map_aggregate(sample.args, place)
    kwargs = fx.node.map_aggregate(sample.kwargs, place)
    node = graph.call_function(target, tuple(args), dict(kwargs))
    fresh = fx.node.map_aggregate(sample.args, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
    node.meta["val"] = target(*fresh, **sample.kwargs)  # on copies: in-place ops keep the inputs
    outputs = [node]
    if isinstance(node.meta["val"], (list, tuple)):
        outputs = []
        import operator

        for i, v in enumerate(node.meta["val"]):
            item = graph.call_function(operator.getitem, (node, i))
            item.meta["val"] = v
            outputs.append(item)
    graph.output(tuple(outputs))
    return graph, placeholders, node, outputs


# --------------------------------------------------------------------------- one spec combination
def input_specs(t: torch.Tensor) -> list[Spec]:
    """Every spec of a data input on the 2x2 mesh: R, P (floating only), S(d) per mesh dim."""
    dims = [d for d in range(t.dim()) if t.shape[d] % (2 * MESH[CP]) == 0]  # cp token order: 2·cp chunks
    options = [Replicate()] + ([Partial()] if _inexact(t) else []) + [Shard(d) for d in dims]
    on_cp = options if MESH[CP] > 1 else [Replicate()]
    # a fused projection's blocks on tp (q, k, v of unequal sizes where the dim allows)
    on_tp = options + [
        InterleavedShard(d, (t.shape[d] // 2, t.shape[d] // 4, t.shape[d] // 4) if t.shape[d] % (4 * MESH[TP]) == 0
                         else (t.shape[d] // 2, t.shape[d] // 2))
        for d in dims if _inexact(t) and t.shape[d] % (2 * MESH[TP]) == 0
    ]
    return [(a, b) for a in on_cp for b in on_tp if not (isinstance(a, Shard) and isinstance(b, Shard) and a.dim == b.dim)] + [
        (Shard(d), Shard(d)) for d in dims if MESH[CP] > 1 and t.shape[d] % (2 * MESH[CP] * MESH[TP]) == 0
    ]


def check(target: Any, sample: Sample, specs: dict[str, Spec], seed: int = 0) -> bool:
    """Localize and run one combination; ``False`` when refused with an ``HGraphError``."""
    graph, placeholders, op_node, outputs = build_graph(target, sample)
    params = frozenset(sample.params)
    options = ShardingOptions(cp=MESH[CP], tp=MESH[TP], params=params, buffers=frozenset())
    free = {p for p in placeholders if p.name in params}
    all_specs: dict[fx.Node, Any] = {p: specs[p.name] for p in placeholders if p.name not in params}
    rin = RuleInput(options, all_specs, free)
    assert lookup(target) is not None, f"{target} has no rule"
    try:
        for node in [op_node, *([] if outputs == [op_node] else outputs)]:
            rin.node = node
            decision = _decide(node, rin)
            for inp, req in decision.inputs.items():
                if inp in free:
                    free.discard(inp)
                    all_specs[inp] = req
            all_specs[node] = decision.output
            node.meta["hgraph_decision"] = decision
        out_node = next(n for n in graph.nodes if n.op == "output")
        from hgraph.rules.base import Decision

        out_node.meta["hgraph_decision"] = Decision(output=None, inputs={})
        for p in free:
            all_specs[p] = (Replicate(), Replicate())
        for node in graph.nodes:
            node.meta["hgraph_spec"] = all_specs.get(node)
        grad_inputs = {p for p in placeholders if _inexact(p.meta["val"])}
        partial = _partial_uses(op_node, op_node.meta["hgraph_decision"], grad_inputs)
        op_node.meta["hgraph_grad_reduce"] = {i: d for i, d in partial.items() if i.name not in params}
        for item in outputs:
            if item is not op_node:
                item.meta["hgraph_grad_reduce"] = {}
        gm = fx.GraphModule(torch.nn.Module(), graph)
        local = bind_rank(localize(gm, options))
    except HGraphError:
        return False
    _run_and_compare(target, sample, placeholders, outputs, all_specs, partial, params, local, seed)
    return True


def _run_and_compare(target, sample, placeholders, outputs, all_specs, partial, params, local, seed) -> None:
    rng = torch.Generator().manual_seed(seed)
    fulls = [p.meta["val"] for p in placeholders]
    summed = [i for i, p in enumerate(placeholders) if any(isinstance(q, Partial) for q in all_specs[p] or ())]
    fulls = [on_grid(f) if i in summed else f for i, f in enumerate(fulls)]
    local_inputs = []
    for p, full in zip(placeholders, fulls):
        token = p.name not in params
        local_inputs.append(partial_terms(full, all_specs[p], token, rng))
    out_vals = [o.meta["val"] for o in outputs]
    if summed and sample.values:
        out_vals = _reference_outputs(target, sample, fulls, out_vals)
    cots = [
        torch.randn(v.shape, generator=rng, dtype=v.dtype) if isinstance(v, torch.Tensor) and _inexact(v) and sample.values else None
        for v in out_vals
    ]

    def body(comm):
        rank = comm.rank
        groups = mesh_groups(rank, MESH)
        xs = [li[rank].clone().requires_grad_(_inexact(li[rank]) and not sample.forward_only) for li in local_inputs]
        result = local(*xs, RankContext(rank, comm, groups))
        pairs = []
        for o, v, c in zip(outputs, result, cots):
            if c is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                pairs.append((v, cut(c, all_specs[o], COORDS[rank], True)))
        if pairs:
            torch.autograd.backward([a for a, _ in pairs], [b for _, b in pairs])
        return [v.detach() if isinstance(v, torch.Tensor) else v for v in result], [x.grad for x in xs]

    results = run_threads(body, WORLD, timeout=30.0)
    label = f"{target} with {', '.join(f'{p.name}={spec_str(all_specs[p])}' for p in placeholders)}"
    for i, (o, v) in enumerate(zip(outputs, out_vals)):
        spec = all_specs[o]
        if not isinstance(v, torch.Tensor) or spec is None:
            # size queries and assertions read the rank's local tensor
            for rank, r in enumerate(results):
                assert r[0][i] == target(*_substitute(sample, [li[rank] for li in local_inputs])[0]), label
            continue
        if not sample.values:
            assert all(r[0][i].dtype == v.dtype for r in results), label
            assemble([torch.zeros_like(r[0][i]) for r in results], v.shape, spec, True, (), label)
            continue
        sums = [m for m, q in enumerate(spec) if isinstance(q, Partial)]
        got = assemble([r[0][i] for r in results], v.shape, spec, True, sums, f"{label}: output {i}")
        torch.testing.assert_close(got, v, equal_nan=True, msg=lambda s, i=i: f"{label}: forward output {i} ({spec_str(spec)}): {s}")
    diff_outs = [(v, c) for v, c in zip(out_vals, cots) if c is not None and not sample.forward_only]
    wanted = [j for j, f in enumerate(fulls) if _inexact(f)]
    if not diff_outs or not wanted:
        return
    leaves = [f.clone().requires_grad_(_inexact(f)) for f in fulls]
    args, kwargs = _substitute(sample, leaves)
    ref_out = target(*args, **kwargs)
    ref_out = list(ref_out) if isinstance(ref_out, (list, tuple)) else [ref_out]
    pairs = [(a, c) for a, c in zip(ref_out, cots) if c is not None and a.requires_grad]
    ref_grads = torch.autograd.grad([a for a, _ in pairs], [leaves[j] for j in wanted], [c for _, c in pairs], allow_unused=True)
    for j, ref in zip(wanted, ref_grads):
        p = placeholders[j]
        pieces = [r[1][j] for r in results]
        if ref is None:
            ref = torch.zeros_like(fulls[j])
        pieces = [torch.zeros_like(li) if g is None else g for g, li in zip(pieces, local_inputs[j])]
        spec = all_specs[p]
        sums = [m for m in partial.get(p, ()) if p.name in params and isinstance(spec[m], Replicate)]
        got = assemble(pieces, fulls[j].shape, spec, p.name not in params, sums, f"{label}: grad of {p.name}")
        torch.testing.assert_close(got, ref, equal_nan=True, msg=lambda s, p=p: f"{label}: gradient of {p.name}: {s}")


def _reference_outputs(target, sample: Sample, fulls: list[torch.Tensor], out_vals: list) -> list:
    """The op's outputs on ``fulls`` (the Partial inputs moved onto their grid), in ``out_vals``' order."""
    args, kwargs = _substitute(sample, [f.clone() for f in fulls])
    with torch.no_grad():
        ref = target(*args, **kwargs)
    ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
    assert len(ref) == len(out_vals), f"{target}: {len(ref)} outputs on full tensors, the graph has {len(out_vals)}"
    return [r if isinstance(v, torch.Tensor) else v for r, v in zip(ref, out_vals)]


def _substitute(sample: Sample, leaves: list[torch.Tensor]) -> tuple[tuple, dict]:
    it = iter(leaves)
    swap = lambda v: next(it) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return fx.node.map_aggregate(sample.args, swap), fx.node.map_aggregate(sample.kwargs, swap)


def preferred_specs(target: Any, sample: Sample) -> dict[str, Spec]:
    """The specs the rule asks of its data inputs when they all arrive replicated."""
    graph, placeholders, op_node, _ = build_graph(target, sample)
    params = frozenset(sample.params)
    options = ShardingOptions(cp=MESH[CP], tp=MESH[TP], params=params, buffers=frozenset())
    rr = (Replicate(), Replicate())
    rin = RuleInput(options, {p: rr for p in placeholders if p.name not in params}, {p for p in placeholders if p.name in params})
    rin.node = op_node
    try:
        decision = _decide(op_node, rin)
    except HGraphError:
        return {}
    return {p.name: decision.inputs.get(p, rr) for p in placeholders if p.name not in params}


def combinations(sample: Sample, limit: Optional[int], seed: int, preferred: dict[str, Spec]) -> list[dict[str, Spec]]:
    """Spec combinations of the data inputs: all of them, or ``limit`` drawn after the ones always
    tried (one input alone non-replicated, all inputs alike, the rule's preferred specs with one
    input changed)."""
    names = [n for n in tensor_names(sample) if n not in sample.params]
    tensors = dict(zip(tensor_names(sample), _tensors(sample)))
    per_input = [input_specs(tensors[n]) for n in names]
    if limit is not None and math.prod(map(len, per_input)) > ENUMERATE:
        return _drawn(names, per_input, limit, seed, preferred)
    everything = [dict(zip(names, combo)) for combo in itertools.product(*per_input)]
    if limit is None or len(everything) <= limit:
        return everything
    rr = (Replicate(), Replicate())
    first = [c for c in everything if sum(s != rr for s in c.values()) <= 1 or len(set(c.values())) == 1]
    if preferred:
        for i, n in enumerate(names):
            for spec in per_input[i]:
                combo = {**preferred, n: spec}
                if combo not in first:
                    first.append(combo)
    rest = [c for c in everything if c not in first]
    random.Random(seed).shuffle(rest)
    return first + rest[: max(0, limit - len(first))]


ENUMERATE = 200_000  # more spec combinations than this (ops of many inputs) are drawn, not listed


def _drawn(names: list[str], per_input: list[list[Spec]], limit: int, seed: int, preferred: dict[str, Spec]) -> list[dict[str, Spec]]:
    """``combinations`` for ops with too many combinations to list: the ones always tried, then
    random draws (seeded) up to ``limit``."""
    rr = (Replicate(), Replicate())
    first = [dict.fromkeys(names, rr)]
    singles = [[{**dict.fromkeys(names, rr), n: spec} for spec in per_input[i] if spec != rr] for i, n in enumerate(names)]
    first += [c for round_ in itertools.zip_longest(*singles) for c in round_ if c is not None]  # round robin
    first += [dict.fromkeys(names, spec) for spec in per_input[0] if all(spec in p for p in per_input[1:])]
    for i, n in enumerate(names):
        first += [{**preferred, n: spec} for spec in per_input[i]] if preferred else []
    out: list[dict[str, Spec]] = []
    for combo in first:
        if combo not in out:
            out.append(combo)
    out = out[:limit]
    rng = random.Random(seed)
    for _ in range(50 * limit):
        if len(out) >= limit:
            break
        combo = {n: rng.choice(p) for n, p in zip(names, per_input)}
        if combo not in out:
            out.append(combo)
    return out


def run_case(
    target: Any, make: Callable[[torch.Generator], Sample], limit: Optional[int], seed: int = 0,
    mesh: tuple[int, int] = (2, 2),
) -> Outcome:
    sample = make(torch.Generator().manual_seed(seed))
    outcome = Outcome()
    _set_mesh(mesh)
    try:
        for combo in combinations(sample, limit, seed, preferred_specs(target, sample)):
            key = ", ".join(f"{k}={spec_str(v)}" for k, v in combo.items())
            (outcome.accepted if check(target, copy.copy(sample), combo, seed) else outcome.refused).append(key)
    finally:
        _set_mesh((2, 2))
    return outcome
