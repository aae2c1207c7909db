"""Row-position terms: values a program computes from the micro-batch's length alone, read by its data.

Packed, the micro-batch's length is the row's, and a position from an ``arange`` over the row does
not restart at a document. Llama 4's NoPE layers scale queries by ``log1p(floor((p + 1) / 8192))·0.1
+ 1`` with ``p`` such a row position: 1 for ``p < 8191``, so packing is exact while rows stay shorter.
A probe of a few hundred tokens cannot see that, and with freshly initialised weights (queries and keys
near 0) not even a probe past 8192 tokens does. ``exact_rows(gm)`` reads it from the graph instead:
it evaluates the terms (cheap: no weights, no data) along a long row and returns how many tokens a row
may hold before a term's value at a position differs from its value at the first one.
"""

from __future__ import annotations

from typing import Any, Optional

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx

from hgraph.rules.base import module_of

ROW_TERM_TOKENS = 1 << 17  # the row the terms are evaluated along: no row longer is proved
_MAX_ELEMENTS = 1 << 26  # a term larger than this along the row (a [row, row] table) is evaluated on a shorter one
_VALUE_TYPES = ("Tensor", "number", "float", "complex")  # schema types whose argument is a value, not a size
_SHORT = 16  # a short row: the terms must give its positions the values the long row gives them


def length_as_value(gm: fx.GraphModule, skip: frozenset[fx.Node] = frozenset()) -> Optional[str]:
    """Where the micro-batch's length (or a number computed from it) enters a tensor as a value (``x /
    seq_len``, ``arange(seq_len)``), outside ``skip``: packed, it is the row's length, not the
    document's. As a size (``view``, ``expand``, slice bounds) it only shapes the tensors."""
    symbol = _length_symbol(gm)
    if symbol is None:
        return None

    def from_length(value: Any) -> bool:
        v = value.meta.get("val") if isinstance(value, fx.Node) else None
        return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and symbol in v.node.expr.free_symbols

    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node in skip:
            continue
        schema = node.target._schema.arguments
        given = list(zip(schema, node.args)) + [(a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs]
        for argument, value in given:
            if from_length(value) and any(t in str(argument.type) for t in _VALUE_TYPES):
                return (f"{node.target} at node '{node.name}'{module_of(node)} takes the sequence length "
                        f"('{value.name}') as a value: packed, that is the micro-batch's length, not the document's")
    return None


def exact_rows(gm: fx.GraphModule) -> Optional[int]:
    """The most tokens a packed row may hold with every row-position term of ``gm`` still equal to
    its value at position 0 (so a document later in the row reads what it reads alone); ``None``
    when ``gm`` has no floating-point term read by data, 0 when a term is not constant along the row,
    the length enters data as a value elsewhere, or a term cannot be evaluated. Evaluated along
    ``ROW_TERM_TOKENS`` tokens (or the longest row the trace allows)."""
    symbol = _length_symbol(gm)
    if symbol is None:
        return None
    terms = _terms(gm, symbol)
    if length_as_value(gm, frozenset(terms)) is not None:
        return 0
    # floating-point values read by data (Llama 4's scale); integer and boolean ones address tokens
    # (routing's token index, a mask packed attention replaces): the probe covers those
    frontier = [n for n in terms if n.meta["val"].dtype.is_floating_point and any(u not in terms for u in n.users)]
    if not frontier:
        return None
    tokens = ROW_TERM_TOKENS
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    upper = getattr(ids.meta["val"].shape[1].node.shape_env.var_to_range.get(symbol), "upper", None)
    if isinstance(upper, (int, sympy.Integer)):
        tokens = min(tokens, int(upper))
    needed = _ancestors(frontier, terms)
    while tokens > _SHORT and max(_elements(n, symbol, tokens) for n in needed) > _MAX_ELEMENTS:
        tokens //= 2
    try:
        long, short = _evaluate(gm, needed, symbol, tokens), _evaluate(gm, needed, symbol, _SHORT)
    except (RuntimeError, TypeError, ValueError):
        return 0
    exact = tokens
    for node in frontier:
        dims = [d for d, size in enumerate(node.meta["val"].shape)
                if isinstance(size, torch.SymInt) and symbol in size.node.expr.free_symbols]
        if len(dims) != 1:  # the length as a scalar value, or a table over two row positions
            return 0
        values = long[node].movedim(dims[0], 0)
        first = values[:1]
        if not torch.equal(short[node].movedim(dims[0], 0), first.expand_as(short[node].movedim(dims[0], 0))):
            return 0
        differs = (values != first).reshape(len(values), -1).any(dim=1).nonzero()
        if len(differs):
            exact = min(exact, int(differs[0]))
    return exact


def _length_symbol(gm: fx.GraphModule) -> Any:
    """The sympy symbol of the micro-batch's length; None for a graph traced for one length."""
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    seq = ids.meta["val"].shape[1]
    return seq.node.expr if isinstance(seq, torch.SymInt) else None


def _terms(gm: fx.GraphModule, symbol: Any) -> set[fx.Node]:
    """Tensor-valued nodes computed from the length symbol and sizes alone (no data, no weights)."""
    terms: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        inputs = node.all_input_nodes
        if inputs and all(n in terms or _size(n) for n in inputs) and any(
            n in terms or symbol in _size(n).node.expr.free_symbols for n in inputs
        ):
            terms.add(node)
    return terms


def _ancestors(nodes: list[fx.Node], terms: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` and the terms they are computed from."""
    found: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(n for n in node.all_input_nodes if n in terms)
    return found


def _size(node: fx.Node) -> Any:
    """The node's symbolic integer/float value when it is a size, else None."""
    value = node.meta.get("val")
    return value if isinstance(value, (torch.SymInt, torch.SymFloat)) else None


def _concrete(value: Any, symbol: Any, tokens: int) -> Any:
    """A size at a row of ``tokens`` tokens (every other symbol, e.g. the batch, 1)."""
    expr = value.node.expr
    number = expr.subs({s: (tokens if s == symbol else 1) for s in expr.free_symbols})
    return int(number) if isinstance(value, torch.SymInt) else float(number)


def _elements(node: fx.Node, symbol: Any, tokens: int) -> int:
    count = 1
    for size in node.meta["val"].shape:
        count *= _concrete(size, symbol, tokens) if isinstance(size, torch.SymInt) else int(size)
    return count


def _evaluate(gm: fx.GraphModule, terms: set[fx.Node], symbol: Any, tokens: int) -> dict[fx.Node, Any]:
    """Every term's value at a row of ``tokens`` tokens."""
    env: dict[fx.Node, Any] = {}

    def value_of(n: fx.Node) -> Any:
        return env[n] if n in env else _concrete(_size(n), symbol, tokens)

    for node in gm.graph.nodes:
        if node in terms:
            args, kwargs = pytree.tree_map_only(fx.Node, value_of, (node.args, node.kwargs))
            env[node] = node.target(*args, **kwargs)
    return env


__all__ = ["ROW_TERM_TOKENS", "exact_rows", "length_as_value"]
