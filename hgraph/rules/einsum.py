"""The rule for ``einsum``, from its equation: every equation, not a list of them.

Each subscript letter is a *batch* letter (in several operands and the output), a *free* letter (in one
operand and the output) or a *summed* letter (not in the output: contracted across operands, or summed
within one). On each mesh dim the first operand cut on a letter decides: every operand that has the
letter (at full size, not broadcast) is cut on it too, the others are replicated, and the output is cut
on the letter — or, for a summed letter, holds a pending sum (Partial), as a row-parallel product does.
einsum is linear in each operand: one Partial operand with the rest replicated keeps the output Partial;
any other Partial operand is reduced first. A letter repeated within one operand (a diagonal, ``ii->i``)
is never cut; on cp (activations cut in the load-balanced token order) neither is a letter a weight has.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Shard
from hgraph.rules.base import CP, TP, P, R, Decision, RuleInput
from hgraph.rules.registry import register

aten = torch.ops.aten


@dataclass(frozen=True)
class Subscripts:
    """An equation with its ellipses spelled out: one letter string per operand, and the output's."""

    operands: tuple[str, ...]
    output: str

    def __str__(self) -> str:
        return ",".join(self.operands) + "->" + self.output


def parse_equation(equation: str, ndims: Sequence[int]) -> Subscripts:
    """``equation`` for operands of ``ndims`` dims, ``...`` replaced by letters the equation does not use
    (right-aligned, as einsum broadcasts them); an implicit output is the letters used once, sorted."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum {equation!r}: {len(terms)} subscripts for {len(ndims)} operands")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in equation]
    width = max((n - len(t.replace("...", "")) for t, n in zip(terms, ndims) if "..." in t), default=0)
    ellipsis = "".join(spare[:width])
    operands = []
    for term, n in zip(terms, ndims):
        if "..." in term:
            head, _, tail = term.partition("...")
            term = head + ellipsis[width - (n - len(head) - len(tail)):] + tail
        if len(term) != n:
            raise ValueError(f"einsum {equation!r}: subscripts {term!r} for an operand of {n} dims")
        operands.append(term)
    if arrow:
        output = rhs.replace("...", ellipsis)
    else:
        counts = {c: "".join(operands).count(c) for c in "".join(operands)}
        output = ellipsis + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ellipsis))
    return Subscripts(tuple(operands), output)


def einsum_rule(node: fx.Node, rin: RuleInput) -> Decision:
    equation, operands = node.args[0], list(node.args[1])
    try:
        subs = parse_equation(equation, [rin.ndim(t) for t in operands])
    except ValueError as exc:
        raise rin.error(str(exc)) from None
    if len(set(operands)) != len(operands):  # one tensor twice (``x·xᵀ``): computed whole
        return Decision(output=(R, R), inputs={t: (R, R) for t in operands}, note="einsum of a repeated operand")
    sizes = [rin.shape(t) for t in operands]
    req = [[R, R] for _ in operands]
    out: list = [R, R]
    for m in (CP, TP):
        if rin.degree(m) == 1:
            continue
        places = [rin.placement(t, m) for t in operands]
        partial = [i for i, p in enumerate(places) if isinstance(p, Partial)]
        if len(partial) == 1 and all(p == R for i, p in enumerate(places) if i != partial[0]):
            req[partial[0]][m], out[m] = P, P  # linear in that operand: the pending sum passes through
            continue
        letter = _cut_letter(subs, places)
        if letter is None:
            continue
        if m == CP and any(letter in term and rin.options.is_param(t) for t, term in zip(operands, subs.operands)):
            continue  # cp cuts activations in the load-balanced token order, weights are whole on cp
        full = max(sizes[i][subs.operands[i].index(letter)] for i in range(len(operands)) if letter in subs.operands[i])
        for i, term in enumerate(subs.operands):
            if letter in term and sizes[i][term.index(letter)] == full:
                req[i][m] = Shard(term.index(letter))
        out[m] = Shard(subs.output.index(letter)) if letter in subs.output else P
    inputs = {t: (r[0], r[1]) for t, r in zip(operands, req)}
    return Decision(output=(out[0], out[1]), inputs=inputs, note=f"einsum {subs}")


def _cut_letter(subs: Subscripts, places: Sequence) -> str | None:
    """The letter the first operand cut (as a plain ``Shard``) on a letter it holds once is cut on."""
    for term, p in zip(subs.operands, places):
        if type(p) is Shard:
            letter = term[p.dim % len(term)]
            if term.count(letter) == 1 and all(t.count(letter) <= 1 for t in subs.operands) and subs.output.count(letter) <= 1:
                return letter
    return None


register(aten.einsum, einsum_rule)
