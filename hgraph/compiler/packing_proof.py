"""The packing proof: is training on packed documents exactly training on each document alone?

Packing puts several documents in one micro-batch, positions restarting at each. That is exact when
nothing carries information from one document to another: no op may mix tokens except
``packed_attention`` (which never crosses a document start), and positions must come from
``position_ids``. ``prove_packing(traced)`` establishes it once per compile, before any packed step:

1. **From the graph.** The sequence length may shape tensors but never enter one as a value
   (``x / seq_len``: packed, it is the row's length). Then the traced program is localized for
   context parallelism (``cp=2``): every data input cut into token chunks, every op given its
   sharding rule. The rules accept cut tokens only where an op is token-local (elsewhere the
   tokens are gathered over cp in order) and refuse an op sized by the sequence (``arange`` over the
   row: positions that do not restart), attention hgraph did not turn into ``packed_attention``,
   cumulative sums, convolutions, recurrences. The program may then communicate over cp only to sum
   the loss. Such a
   program computes every token from its own inputs, its position id and its document's keys:
   packing is exact. (A model traced per shape is left to the probe.)
2. **By probing**, where the graph cannot show it (mixture-of-experts routing sorts the tokens of a
   micro-batch; that is token-local, but not op by op): the traced program runs on documents packed
   together and on each alone, at lengths past every length constant in the graph (up to
   ``PROBE_MAX_TOKENS``), a long document first and last; every token's loss must agree.

Where the row's length enters the program as a value (Llama 4's NoPE layers scale queries by a function
of the position in the *row*, from an ``arange`` over it: 1 below 8192 tokens), the probe shows packing
exact only for its short rows; ``hgraph.compiler.row_terms`` evaluates those terms along a long row and
finds how long a row may be with them constant. The proof records it (``PackingProof.checked_tokens``),
and ``check_rows`` raises a ``PackingError`` naming the construct, the row length and the fix before a
longer packed row trains.

A model neither way proves is trained one document per micro-batch, with a ``PackingWarning``
naming the module and construct and the cost measured on the probe (``packing="auto"``), or refused
with a ``PackingError`` (``packing="require"``). ``packing="off"`` never packs. Never packed silently.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import fx

from hgraph.compiler.row_terms import exact_rows, length_as_value
from hgraph.core.batch import next_token_targets
from hgraph.errors import HGraphError, PackingError
from hgraph.core.model_info import model_dims
from hgraph.frontend.mask_probe import longest_traced
from hgraph.passes.annotate import annotate
from hgraph.passes.localize import localize
from hgraph.program.options import PACKING_MODES
from hgraph.program.products import PackingProof
from hgraph.rules.mesh import ShardingOptions
from hgraph.rules.base import module_of, op_name

if TYPE_CHECKING:
    from hgraph.frontend import TracedModel

PROBE_MAX_TOKENS = 512  # length constants beyond this (feature sizes, vocabularies) are not probed past
_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default


class PackingWarning(UserWarning):
    """Packing is not proved exact for this model: it trains one document per micro-batch."""


def prove_packing(traced: "TracedModel", mode: str = "auto") -> PackingProof:
    """The ``PackingProof`` of ``traced`` (module docstring); ``mode`` as ``CompileOptions.packing``.
    ``traced`` is the fp32 trace (a bf16 ``compute_dtype`` is applied later, by the precision pass), so
    no rounding hides a small leak from the probe."""
    if mode not in PACKING_MODES:
        raise HGraphError(f"packing={mode!r}; expected one of {', '.join(map(repr, PACKING_MODES))}")
    construct = graph_proof(traced)
    if construct is None:
        return PackingProof(True, "graph", mode=mode)
    if mode == "off":  # not packed anyway: the probe would change nothing
        return PackingProof(False, "unproved", construct, mode=mode)
    proof = replace(probe(traced, construct), mode=mode)
    if proof.exact and traced.dynamic and length_as_value(traced.graph_module) is not None:
        rows = exact_rows(traced.graph_module)  # how long a row keeps the terms constant
        if rows is not None:  # past the probe's rows, as the terms say
            proof = replace(proof, checked_tokens=max(rows, max(sum(p) for p in proof.probe_lengths)))
    if not proof.exact:
        model = type(traced.model).__name__
        if mode == "require":
            raise PackingError(
                f"{model}: {proof}. packing='require' refuses to train it; fix the construct, or compile "
                "with packing='auto' to train one document per micro-batch"
            )
        warnings.warn(PackingWarning(f"{model}: {proof}"), stacklevel=3)
    return proof


def check_rows(traced: "TracedModel", proof: PackingProof, tokens: int) -> None:
    """Raise ``PackingError`` where ``proof`` packs but covers only rows shorter than ``tokens``
    (``checked_tokens``: the program reads positions in the row)."""
    if not proof.packs or proof.checked_tokens is None or tokens <= proof.checked_tokens:
        return
    raise PackingError(
        f"{type(traced.model).__name__}: a packed micro-batch of {tokens} tokens, but packing is exact only "
        f"for micro-batches of up to {proof.checked_tokens} tokens, because {proof.construct} (a value computed "
        f"from the position in the row, checked constant only that far). Use micro_batch_tokens <= {proof.checked_tokens} "
        "(a longer document still gets a micro-batch of its own; a planner packs up to its MaxLen), or "
        "compile with packing='off'"
    )


# ----------------------------------------------------------------------------- from the graph
def graph_proof(traced: "TracedModel") -> Optional[str]:
    """``None`` when the graph shows every token depends only on its own document (module
    docstring, 1.); else what it cannot show: the refused op (node, module) or the communication."""
    if not traced.dynamic:
        return "the model specialises on its input shape (one graph per length): only probes can show it"
    length = length_as_value(traced.graph_module)
    if length is not None:
        return length
    gm = copy.deepcopy(traced.graph_module)
    options = ShardingOptions(cp=2, tp=1, params=frozenset(traced.param_names),
                              buffers=frozenset(traced.buffer_names))
    try:
        local = localize(annotate(gm, options), options)
    except HGraphError as exc:  # the rule's message names the op, node and module
        return f"the graph does not show every token reading only its own document: {exc}"
    output = next(n for n in local.graph.nodes if n.op == "output")
    for node in local.graph.nodes:
        info = node.meta.get("hgraph_comm")
        if not info or info["mesh_dim"] != "cp" or info["direction"] != "forward":
            continue
        if set(node.users) <= {output}:  # summing the loss over the token chunks
            continue
        return (f"{info['op']} of '{info['tensor']}' over tokens (node '{node.name}'){_consumer(node)}: it mixes "
                "every token of a micro-batch")
    return None


def _consumer(comm: fx.Node) -> str:
    """`` for <op> at node '<name>' in <module>``: the first op of the model that a communication
    feeds (past the local reshuffles of its tokens), or ``""``."""
    todo, seen = list(comm.users), set()
    while todo:
        user = todo.pop(0)
        if user in seen:
            continue
        seen.add(user)
        if "nn_module_stack" in user.meta and "hgraph_comm" not in user.meta:
            return f" for {op_name(user.target)} at node '{user.name}'{module_of(user)}"
        todo.extend(user.users)
    return ""


# ----------------------------------------------------------------------------- by probing
def probe_documents(traced: "TracedModel") -> tuple[tuple[int, ...], ...]:
    """The probes' document lengths: a document past every length constant of the graph (capped
    at ``PROBE_MAX_TOKENS``, and so that the packed row fits the longest sequence the trace allows),
    first among short ones and last after them."""
    constants = [c for c in _constants(traced.graph_module) if c <= PROBE_MAX_TOKENS]
    longest = max([traced.example_shape[1], *constants]) + 3
    positions = next(n for n in traced.graph_module.graph.nodes if n.op == "placeholder" and n.name == "position_ids")
    seq = positions.meta["val"].shape[1]
    if isinstance(seq, torch.SymInt):
        longest = max(2, min(longest, longest_traced(seq) - 8))
    return ((longest, 3, 1, 2), (2, 5, 1, longest))


def probe(traced: "TracedModel", construct: str = "") -> PackingProof:
    """Run the traced program on each probe's documents packed and alone; compare every token's loss."""
    vocab = model_dims(traced.model).get("vocab") or 2
    generator = torch.Generator().manual_seed(0)
    probes = probe_documents(traced)
    programs: dict[int, Optional[fx.GraphModule]] = {}  # graph -> its per-token variant
    params = _stand_in_parameters(traced)
    seconds = {"packed": 0.0, "alone": 0.0}
    for lengths in probes:
        documents = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
        try:
            packed = _token_losses(traced, documents, programs, seconds, "packed", params)
            alone = [_token_losses(traced, [d], programs, seconds, "alone", params) for d in documents]
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # the program cannot run the probe
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            finding = f"the program cannot run documents {tuple(lengths)} packed ({type(exc).__name__}: {first})"
            return PackingProof(False, "unproved", construct, finding, probes)
        finding = _first_difference(packed, alone, lengths)
        if finding:
            return PackingProof(False, "unproved", construct, finding, probes,
                                seconds["packed"] * 1e3, seconds["alone"] * 1e3)
    return PackingProof(True, "probe", construct, "", probes, seconds["packed"] * 1e3, seconds["alone"] * 1e3)


def _token_losses(
    traced: "TracedModel", documents: Sequence[torch.Tensor], programs: dict[int, Optional[fx.GraphModule]],
    seconds: dict[str, float], clock: str, params: Optional[dict[str, torch.Tensor]] = None,
) -> list[torch.Tensor]:
    """Per document, its tokens' losses (float64) when ``documents`` share one packed row; the
    forward's time is added to ``seconds[clock]`` (building the program is not timed)."""
    ids = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(len(d)) for d in documents])[None]
    targets = torch.cat([next_token_targets(d) for d in documents])[None]
    gm = traced.graph_for(*ids.shape)
    if id(gm) not in programs:
        programs[id(gm)] = _per_token_program(gm)
    per_token = programs[id(gm)]
    best = float("inf")
    for _ in range(3):  # a quick forward is timed three times (the best counts): timer noise
        start = time.perf_counter()
        losses = _run_token_losses(traced, gm, per_token, documents, ids, positions, targets, params)
        best = min(best, time.perf_counter() - start)
        if best > 0.05:
            break
    seconds[clock] += best
    return losses


def _run_token_losses(
    traced: "TracedModel", gm: fx.GraphModule, per_token: Optional[fx.GraphModule], documents: Sequence[torch.Tensor],
    ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, params: Optional[dict[str, torch.Tensor]] = None,
) -> list[torch.Tensor]:
    with torch.no_grad():
        if per_token is not None:
            losses = per_token(*traced.flat_args(ids, positions, targets, params)).double().reshape(-1)
            return list(torch.split(losses, [len(d) for d in documents]))
        out, start = [], 0  # a loss hgraph cannot split by token: one document's targets at a time
        for d in documents:
            only = torch.full_like(targets, -100)
            only[:, start : start + len(d)] = targets[:, start : start + len(d)]
            out.append(gm(*traced.flat_args(ids, positions, only, params)).double().reshape(1))
            start += len(d)
        return out


def _stand_in_parameters(traced: "TracedModel") -> Optional[dict[str, torch.Tensor]]:
    """Seeded random values for parameters on the meta device (a model compiled before its weights
    are loaded), so the probe can run: packing exactness is a property of the program, not of the
    weights. Matrices ``randn / sqrt(fan_in)``, vectors uniform in [0.5, 1.5], keeping activations
    O(1) so a leak shows in the losses. None when every parameter holds values."""
    meta = {fqn: p for fqn, p in traced.params().items() if p.is_meta}
    if not meta:
        return None
    generator = torch.Generator().manual_seed(0)
    out = {}
    for fqn, p in meta.items():
        if p.dim() >= 2:
            value = torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5
        else:
            value = 0.5 + torch.rand(p.shape, generator=generator)
        out[fqn] = value.to(p.dtype)
    return out


def _per_token_program(gm: fx.GraphModule) -> Optional[fx.GraphModule]:
    """A copy of ``gm`` returning every token's loss, when its output is a ``cross_entropy_loss``."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    (result,) = output.all_input_nodes
    if result.target is not _CROSS_ENTROPY:
        return None
    copied = copy.deepcopy(gm)
    loss = next(n for n in copied.graph.nodes if n.op == "output").all_input_nodes[0]
    args = list(loss.args) + [None, 1, -100, 0.0][len(loss.args) - 2:]
    args[3] = 0  # reduction "none"
    loss.args = tuple(args)
    copied.recompile()
    return copied


def _first_difference(packed: list[torch.Tensor], alone: list[list[torch.Tensor]], lengths: Sequence[int]) -> str:
    """'' when every token's loss agrees, else where the first one differs."""
    for i, (got, (want,)) in enumerate(zip(packed, alone)):
        tolerance = 1e-4 + 1e-4 * want.abs()
        bad = ((got - want).abs() > tolerance).nonzero().flatten()
        if len(bad):
            t = int(bad[0])
            where = f"token {t}" if len(got) > 1 else "its loss"
            return (f"document {i} of lengths {tuple(lengths)} packed together, {where}: loss "
                    f"{float(got[t]):.6g} packed, {float(want[t]):.6g} alone")
    return ""


def _constants(gm: fx.GraphModule) -> list[int]:
    """Integers the graph's ops use (shape arguments, sizes, indices)."""
    found: list[int] = []

    def visit(value: Any) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, int):
            found.append(abs(value))
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for node in gm.graph.nodes:
        if node.op == "call_function":
            visit(node.args)
            visit(list(node.kwargs.values()))
    return found


__all__ = ["check_rows", "PROBE_MAX_TOKENS", "PackingWarning", "graph_proof", "probe",
           "probe_documents", "prove_packing"]
