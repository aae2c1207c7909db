"""Proving what an attention's score terms are: the packed block-causal mask, its window or chunks, ALiBi.

``prove_attention(gm, probes, positions, example_args)`` runs the score-term computations of ``gm``
alone on probe position ids and reports, per attention, the ``AttentionPattern`` it equals on every
probe (or ``NOT_CAUSAL``). The term ``T[b, h, i, j]`` added to the score of query ``i`` and key ``j``
is a mask (sdpa's ``attn_mask``) or, for attention written out by hand, the softmax input with the
``q·kᵀ`` operands set to zero (which leaves every bias and mask the model adds). A pattern holds when

* the keys a query may see (``T > -1e4``, or a ``True`` boolean) are exactly those of its own
  sequence up to itself — and within ``window`` tokens when the longest probe shows a window (Mistral),
  or within its own ``chunk``-token chunk of the document (Llama 4's chunked attention);
* inside them ``T[i, j] − T[i, i] = −slopeₕ·(i − j)`` for one slope per head (ALiBi; all slopes zero
  is a plain mask). A constant per query row is allowed: the softmax ignores it.

Which probes: the model's own view of one document is what packed training must reproduce, so every
term is probed on unpacked rows (positions ``0..L-1``). A term computed from ``position_ids`` is also
probed on packed rows and must be block-causal there (HuggingFace builds such masks to detect packed
sequences). A term computed from sizes alone cannot see documents at all: it is the model's causal
mask over one document, and packed attention applies it to each document. A probe no longer than a
length constant cannot tell a window of that many tokens from plain causality (the bug that made
Mistral's window silently disappear), so with dynamic shapes the terms are also probed on sequences
longer than every constant in their computation — up to the longest sequence the trace allows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
from torch import fx

log = logging.getLogger(__name__)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


_MAX_PROBE = 8192  # longest probe sequence; a term whose constants need more is not proved
_MASKED = -1e4  # a score term at or below this hides the key (HF uses the dtype's minimum)


NOT_CAUSAL = object()


@dataclass(frozen=True)
class AttentionPattern:
    """What an attention's score terms were proved to be: block-causal inside each sequence, within
    ``window`` tokens if set, inside its own ``chunk`` of the sequence if set, plus ALiBi
    ``−alibi[h]·(i − j)`` per query head if set."""

    window: Optional[int] = None
    alibi: Optional[tuple[float, ...]] = None
    chunk: Optional[int] = None

    def __str__(self) -> str:
        parts = ["block-causal"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk}")
        if self.alibi is not None:
            parts.append("ALiBi slopes " + ", ".join(f"{s:.4g}" for s in self.alibi))
        return ", ".join(parts)


@dataclass(frozen=True)
class ScoreTerms:
    """One attention to probe: ``value`` evaluates to its score terms once the ``zeroed`` nodes (the
    ``q·kᵀ`` operands of hand-written attention) are zeros; ``terms``: the nodes whose inputs decide
    whether the terms read ``position_ids``."""

    value: fx.Node
    terms: tuple[fx.Node, ...]
    zeroed: tuple[fx.Node, ...] = ()


def prove_attention(
    gm: fx.GraphModule, probes: list[ScoreTerms], positions: fx.Node, example_args: Sequence[Any],
    reads_positions: Sequence[bool],
) -> list[Any]:
    """Per attention: its ``AttentionPattern`` or ``NOT_CAUSAL`` (module docstring).
    ``reads_positions[i]``: whether attention ``i``'s terms are computed from ``position_ids``."""
    needed, zeroed = _needed_nodes(probes)
    probe = _probe_module(gm, probes, needed, zeroed)
    slot = [n for n in gm.graph.nodes if n.op == "placeholder"].index(positions)
    batch, seq = _val(positions).shape
    example_batch, example_seq = tuple(example_args[slot].shape)
    lengths = [example_seq]
    if not isinstance(seq, int):  # one graph serves every length: probe past the terms' constants
        longest = max([example_seq, *(_length_constants(gm, needed))]) + 3
        if longest > _MAX_PROBE:
            return [NOT_CAUSAL] * len(probes)
        lengths = sorted({example_seq, min(longest, longest_traced(seq))})
    rows = example_batch if isinstance(batch, int) else 2
    symbols = {d.node.expr: i for i, d in enumerate((batch, seq)) if isinstance(d, torch.SymInt)}

    def terms_for(position_ids: torch.Tensor) -> Any:
        args = _resized_inputs(gm, list(example_args), slot, position_ids)
        sizes = {sym: position_ids.shape[i] for sym, i in symbols.items()}
        zeros = [torch.zeros(_concrete(_val(z).shape, sizes), dtype=_val(z).dtype) for z in zeroed]
        with torch.no_grad():
            return probe(*args, *zeros)

    try:
        unpacked = {n: torch.arange(n).expand(rows, n).contiguous() for n in lengths}
        longest_terms = terms_for(unpacked[lengths[-1]])
        found = [_pattern(t, lengths[-1]) for t in longest_terms]
        ok = [f is not None for f in found]
        for length in lengths:
            checks = [unpacked[length], _packed_positions((rows, length))]
            for k, position_ids in enumerate(checks):
                for i, value in enumerate(terms_for(position_ids)):
                    if ok[i] and (k == 0 or reads_positions[i]):
                        ok[i] = _holds(value, position_ids, found[i])
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # a term that cannot run at a probe size
        log.info("attention score terms not proven (they fail at a probe size: %s); attention kept as traced", exc)
        return [NOT_CAUSAL] * len(probes)
    return [f if good else NOT_CAUSAL for f, good in zip(found, ok)]


def _needed_nodes(probes: list[ScoreTerms]) -> tuple[set[fx.Node], list[fx.Node]]:
    """The nodes that compute the probed values (stopping at zeroed operands), and the zeroed ones."""
    zeroed = list(dict.fromkeys(z for p in probes for z in p.zeroed))
    stop = set(zeroed)
    needed: set[fx.Node] = set()
    stack = [p.value for p in probes]
    while stack:
        current = stack.pop()
        if current not in needed and current not in stop:
            needed.add(current)
            stack.extend(current.all_input_nodes)
    return needed, zeroed


def _probe_module(gm: fx.GraphModule, probes: list[ScoreTerms], needed: set[fx.Node], zeroed: list[fx.Node]) -> fx.GraphModule:
    """``(*placeholders of gm, *zeroed values) -> (each probed value)``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    for i, node in enumerate(zeroed):
        env[node] = graph.placeholder(f"zeroed_{i}")
    for node in gm.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[p.value] for p in probes))
    return fx.GraphModule(gm, graph)


def _concrete(shape: Sequence[Any], sizes: dict[Any, int]) -> list[int]:
    """A symbolic shape at the probe's batch and sequence sizes."""
    out = []
    for d in shape:
        if isinstance(d, torch.SymInt):
            expr = sympy.sympify(d.node.expr).xreplace({k: sympy.Integer(v) for k, v in sizes.items()})
            if expr.free_symbols:
                raise ValueError(f"size {d} depends on more than batch and sequence")
            out.append(int(expr))
        else:
            out.append(int(d))
    return out


def longest_traced(seq: torch.SymInt) -> int:
    """The longest sequence a dynamic graph was traced for (its symbol's upper bound; MPT's is its
    ALiBi table's length − 1), at most ``_MAX_PROBE``."""
    node = seq.node
    bound = node.shape_env.var_to_range.get(node.expr)
    upper = getattr(bound, "upper", None)
    if not isinstance(upper, (int, sympy.Integer)):  # unbounded (torch's int_oo) or unknown
        return _MAX_PROBE
    return min(_MAX_PROBE, int(upper))


def _length_constants(gm: fx.GraphModule, nodes: set[fx.Node]) -> list[int]:
    """Magnitudes of the numbers a term computation uses (args and small tensor constants)."""
    found: list[int] = []

    def visit(value: Any) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)) and abs(value) < 2**31:
            found.append(int(abs(value)) + 1)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for node in nodes:
        if node.op == "get_attr":
            constant = getattr(gm, node.target)
            if isinstance(constant, torch.Tensor) and constant.numel() <= 4096:
                found.extend(int(abs(x)) + 1 for x in constant.flatten().tolist())
                found.extend(constant.shape)
        elif node.op == "call_function":
            visit(node.args)
            visit(list(node.kwargs.values()))
    return found


def _resized_inputs(gm: fx.GraphModule, args: list[Any], slot: int, position_ids: torch.Tensor) -> list[Any]:
    """Example inputs with ``position_ids`` in ``slot`` and the other data inputs resized to match."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = list(args)
    out[slot] = position_ids
    for i, node in enumerate(placeholders):
        if node.name in ("input_ids", "targets") and isinstance(args[i], torch.Tensor):
            out[i] = torch.zeros(position_ids.shape, dtype=args[i].dtype)
    return out


def _packed_positions(shape: tuple[int, int]) -> torch.Tensor:
    """Packed rows: short sequences of 1-4 tokens, and one long sequence then short ones."""
    batch, seq = shape
    rows = []
    for row in range(batch):
        if row % 2 and seq >= 5:
            lengths = [seq - 3, 2, 1]
        else:
            lengths, total, k = [], 0, row
            while total < seq:
                lengths.append(min((1, 3, 2, 4)[k % 4], seq - total))
                total += lengths[-1]
                k += 1
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def _allowed_and_bias(value: Any) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(keys allowed, additive bias or None)`` of a 4-d term (``True``/finite: allowed)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return None
    if value.dtype == torch.bool:
        return value, None
    if not value.is_floating_point():
        return None
    return value > _MASKED, value


def _expected(position_ids: torch.Tensor, window: Optional[int] = None, chunk: Optional[int] = None) -> torch.Tensor:
    """[b, s, s] bool: query i may see key j iff same sequence, j <= i (and i - j < window; and i, j in
    the same ``chunk`` of their sequence)."""
    index = torch.arange(position_ids.shape[1])
    starts = torch.where(position_ids == 0, index, torch.zeros_like(index)).cummax(dim=1).values
    allowed = (starts[:, :, None] == starts[:, None, :]) & (index[None, :] <= index[:, None])
    if window is not None:
        allowed = allowed & (index[None, None, :] > index[None, :, None] - window)
    if chunk is not None:
        inside = index[None, :] - starts
        allowed = allowed & ((inside[:, :, None] // chunk) == (inside[:, None, :] // chunk))
    return allowed


def _pattern(value: Any, length: int) -> Optional[AttentionPattern]:
    """The window and slopes shown by the terms of an unpacked row of ``length`` tokens (the last
    query: how many keys it sees, and how its term falls off with distance)."""
    split = _allowed_and_bias(value)
    if split is None or split[0].shape[-1] != length or split[0].shape[-2] != length:
        return None
    allowed, bias = split
    row = allowed[0, 0]
    seen = row.sum(-1)
    count = int(seen[-1])
    candidates = [AttentionPattern()]  # the shape: plain, a window (the last query's keys), a chunk
    if count < length:
        candidates.append(AttentionPattern(window=count))
    alone = [q for q in range(1, length) if int(seen[q]) == 1]  # the first query seeing only itself
    if alone:
        candidates.append(AttentionPattern(chunk=alone[0]))
    unpacked = torch.arange(length)[None]
    shape = next((c for c in candidates if torch.equal(row, _expected(unpacked, c.window, c.chunk)[0])), None)
    if shape is None:
        return None
    if bias is None or count < 2:
        return shape
    last = bias[0, :, -1].double()  # [heads, keys]
    first = length - count
    slopes = (last[:, -1] - last[:, first]) / (length - 1 - first)
    tolerance = _tolerance(bias, allowed)
    if bool((slopes.abs() * (length - 1 - first) <= tolerance).all()):
        return shape
    return dataclasses.replace(shape, alibi=tuple(slopes.tolist()))


def _tolerance(bias: torch.Tensor, allowed: torch.Tensor) -> float:
    """How far a bias may stray from the fitted line: a few rounding steps of its largest value."""
    largest = float(bias.masked_fill(~allowed, 0).abs().max()) if bool(allowed.any()) else 0.0
    return 16 * torch.finfo(bias.dtype).eps * (1.0 + largest)


def _holds(value: Any, position_ids: torch.Tensor, pattern: AttentionPattern) -> bool:
    """Whether a term value is ``pattern`` on these positions."""
    split = _allowed_and_bias(value)
    if split is None:
        return False
    allowed, bias = split
    expected = _expected(position_ids, pattern.window, pattern.chunk)
    try:
        full = torch.broadcast_shapes(allowed.shape, (expected.shape[0], 1, *expected.shape[1:]))
    except RuntimeError:
        return False
    if not torch.equal(allowed.expand(full), expected[:, None].expand(full)):
        return False
    if bias is None:
        return pattern.alibi is None
    tolerance = _tolerance(bias, allowed)
    index = torch.arange(bias.shape[-1], dtype=torch.float64)
    distance = index[:, None] - index[None, :]  # i - j
    slopes = torch.tensor(pattern.alibi or (0.0,) * bias.shape[1], dtype=torch.float64)
    if bias.shape[1] not in (1, len(slopes)):
        return False
    for h in range(bias.shape[1]):  # one head at a time: [b, s, s] in float64
        b = bias[:, h].double()
        relative = b - torch.diagonal(b, dim1=-2, dim2=-1)[..., :, None]
        error = (relative + slopes[h if len(slopes) > 1 else 0] * distance).abs()
        if bool((error.masked_fill(~allowed[:, h].expand_as(error), 0) > tolerance).any()):
            return False
    return True


__all__ = ["NOT_CAUSAL", "AttentionPattern", "ScoreTerms", "longest_traced", "prove_attention"]
