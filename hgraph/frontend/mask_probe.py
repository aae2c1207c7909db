"""Proving that an attention mask computed from ``position_ids`` is the packed block-causal mask.

``block_causal(gm, masks, positions, example_args)`` runs the mask computations of ``gm`` alone on
probe position ids — unpacked rows, rows of short sequences, a row with one long sequence — and
reports, per mask, its variant — ``{}`` (plain block-causal), ``{"window": w}`` (a sliding window,
Mistral) or ``{"chunk": c}`` (Llama 4's chunked attention: a query sees the earlier keys of its own
``c``-token chunk of the document) — or ``NOT_CAUSAL``. A probe no longer than a length constant of
the mask cannot tell a window (chunk) of that many tokens from plain causality (the bug that made
Mistral's window silently disappear), so with dynamic shapes the mask is also probed on sequences
longer than every constant in its computation; the variant is read from that longest probe and then
checked on every probe.

A mask computed without ``position_ids`` (gpt-oss and GraniteMoE build theirs from the sizes alone)
describes one document per row; ``unpacked=True`` probes such masks on unpacked rows only, and the
frontend then runs the variant it proves on every packed document, as the model runs a document alone.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


_MAX_PROBE = 8192  # longest probe sequence; a mask whose constants need more keeps its computation


NOT_CAUSAL = object()


def block_causal(
    gm: fx.GraphModule, masks: list[fx.Node], positions: fx.Node, example_args: Sequence[Any], unpacked: bool = False
) -> list[Any]:
    """Per mask: its variant (``{}``: plain block-causal, ``{"window": w}``, ``{"chunk": c}``) or
    ``NOT_CAUSAL``; ``unpacked``: probe one document per row only (masks that ignore positions).

    A probe no longer than a length constant of the mask cannot tell a window of that many tokens
    from plain causality, so the mask is probed on sequences longer than every constant in its
    computation (and on the example's length); only a mask equal to one block-causal mask, with one
    window, on every probe is replaced.
    """
    needed: set[fx.Node] = set()
    stack = list(masks)
    while stack:
        current = stack.pop()
        if current not in needed:
            needed.add(current)
            stack.extend(current.all_input_nodes)
    probe_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = probe_graph.node_copy(node, lambda n: env[n])
    probe_graph.output(tuple(env[m] for m in masks))
    probe = fx.GraphModule(gm, probe_graph)
    slot = [n for n in gm.graph.nodes if n.op == "placeholder"].index(positions)
    batch, seq = _val(positions).shape
    example_batch, example_seq = tuple(example_args[slot].shape)
    lengths = [example_seq]
    if not isinstance(seq, int):  # one graph serves every length: probe past the mask's constants
        longest = max([example_seq, *(_length_constants(gm, needed))]) + 3
        if longest > _MAX_PROBE:
            return [NOT_CAUSAL] * len(masks)
        lengths = sorted({example_seq, longest})
    rows = example_batch if isinstance(batch, int) else 2

    def masks_for(position_ids: torch.Tensor) -> Any:
        args = _resized_inputs(gm, list(example_args), slot, position_ids)
        with torch.no_grad():
            return probe(*args)

    probes = {length: _probe_positions((rows, length))[: 1 if unpacked else None] for length in lengths}
    # The variant is read where it must show (the longest probe, unpacked), then checked everywhere.
    unpacked_longest = probes[lengths[-1]][0]
    variants = [_variant_of(mask, unpacked_longest) for mask in masks_for(unpacked_longest)]
    ok = [variant is not None for variant in variants]
    for length in lengths:
        for position_ids in probes[length]:
            for i, value in enumerate(masks_for(position_ids)):
                ok[i] = ok[i] and _allows_exactly(value, _expected_mask(position_ids, **(variants[i] or {})))
    return [variant if good else NOT_CAUSAL for variant, good in zip(variants, ok)]


def _length_constants(gm: fx.GraphModule, nodes: set[fx.Node]) -> list[int]:
    """Magnitudes of the numbers a mask computation uses (args and small tensor constants)."""
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


def _variant_of(mask: Any, position_ids: torch.Tensor) -> dict[str, int] | None:
    """The variant (``{}``, a window, a chunk) of ``mask`` on the unpacked ``position_ids``: read from
    the first row (the last query's visible keys give a window; the first query that sees only
    itself, a chunk) and kept when it reproduces the whole mask; None when none does."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    length = position_ids.shape[1]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.shape[-1] != length or allowed.shape[-2] != length:
        return None
    row = allowed[0, 0]
    seen = row.sum(-1)
    candidates: list[dict[str, int]] = [{}]
    if int(seen[-1]) < length:
        candidates.append({"window": int(seen[-1])})
    alone = [q for q in range(1, length) if int(seen[q]) == 1]
    if alone:
        candidates.append({"chunk": alone[0]})
    for candidate in candidates:
        if torch.equal(row, _expected_mask(position_ids[:1], **candidate)[0]):
            return candidate
    return None


def _probe_positions(shape: tuple[int, int]) -> list[torch.Tensor]:
    """Unpacked rows, and packed rows: short sequences of 1-4 tokens, and one long sequence then short ones."""
    batch, seq = shape
    unpacked = torch.arange(seq).expand(batch, seq).contiguous()
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
    return [unpacked, torch.stack(rows)]


def _expected_mask(position_ids: torch.Tensor, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
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


def _allows_exactly(mask: Any, expected: torch.Tensor) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return False
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool((mask[~allowed] <= -1e4).all()):
            return False
    else:
        return False
    try:
        full = torch.broadcast_shapes(allowed.shape, (expected.shape[0], 1, *expected.shape[1:]))
    except RuntimeError:
        return False
    return torch.equal(allowed.expand(full), expected[:, None].expand(full))


__all__ = ["NOT_CAUSAL", "block_causal"]
