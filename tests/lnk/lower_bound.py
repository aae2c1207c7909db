"""An independent lower bound on the bytes of a layout change, from the two layouts alone.

Nothing here comes from ``hgraph.lnk``: holders and needers are read off ``Layout.region`` /
``Layout.term`` and the union rules, element by element, and the cost of one element is:

* non-Partial destination, needed by ranks ``D`` (in any destination representation): if some rank holds the whole value (a representation
  with a single term there), every rank of ``D`` without it receives at least one message:
  ``|D \\ holders|``; otherwise, for a representation with ``k >= 2`` terms, the ``k`` terms must be
  merged (``k - 1`` messages, one more when no rank of ``D`` holds a term: the first rank to know the
  sum must then receive all ``k``), and every other rank of ``D`` needs a message of its own:
  ``k - 1 + |D| - [D holds a term]``, minimised over representations;
* Partial destination: each destination term ``j`` (needed by ``D_j``) is the sum of a set ``G_j`` of
  the source terms, the sets splitting the terms; a group costs as above (``|D_j \\ holders|`` for one
  term, ``|G_j| - 1 + |D_j| - [D_j holds one of them]`` for several, 0 when empty), minimised over
  every split, enumerated exhaustively (``exact`` is False when an element has too many splits to
  enumerate; there the bound is a floor: ``k`` minus the terms whose holders include all of some
  ``D_j``). A Partial destination with several representations (a "duplicate" union of Partial
  layouts) may share messages between them; there the bound is the largest single representation's
  and is not ``exact`` either.

``test_lower_bound.py`` checks these per-element costs against a breadth-first search over all
message sequences on tiny cases (values: sums of source terms).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict

from hgraph.core.layout import Layout

MAX_SPLITS = 20_000


def holders(layout) -> list[tuple[int, tuple, int, tuple]]:
    """``(rank, box, representation, term)`` for every rank of a Layout or LayoutUnion."""
    if isinstance(layout, Layout):
        return [(r, layout.region(r), 0, layout.term(r)) for r in layout.ranks]
    out = []
    offset = 0
    for p, inner in enumerate(layout.layouts):
        for r in inner.ranks:
            box, term, rep = inner.region(r), inner.term(r), 0
            if layout.hetero == "split":
                box = ((box[0][0] + offset, box[0][1] + offset),) + box[1:]
            elif layout.hetero == "duplicate":
                rep = p
            else:
                term = (p,) + term
            out.append((r, box, rep, term))
        offset += inner.shape[0]
    return out


def _partial(layout) -> bool:
    return any(term for _, _, _, term in holders(layout))


def _at(entries, element) -> dict:
    """representation -> term -> frozenset of ranks whose box contains ``element``."""
    out: dict = defaultdict(lambda: defaultdict(set))
    for rank, box, rep, term in entries:
        if all(lo <= x < hi for x, (lo, hi) in zip(element, box)):
            out[rep][term].add(rank)
    return {rep: {t: frozenset(rs) for t, rs in terms.items()} for rep, terms in out.items()}


def _group_cost(group: tuple[frozenset, ...], need: frozenset) -> int:
    if not group:
        return 0
    if len(group) == 1:
        return len(need - group[0])
    held = any(need & h for h in group)
    return len(group) - 1 + len(need) - held


@functools.lru_cache(maxsize=None)
def _full_value(have: tuple, need: frozenset) -> int:
    complete = frozenset().union(*(next(iter(terms)) for _, terms in have if len(terms) == 1))
    if complete:
        return len(need - complete)
    return min(_group_cost(terms, need) for _, terms in have)


@functools.lru_cache(maxsize=None)
def _split(terms: tuple[frozenset, ...], needs: tuple[frozenset, ...]) -> tuple[int, bool]:
    """Cheapest split of ``terms`` among destination terms needed by ``needs``; exact or a floor."""
    k, kd = len(terms), len(needs)
    if kd ** k > MAX_SPLITS:
        # Floor: a split costs k + sum over non-empty groups of (|D_j| - 1 - h_j), each at least -1
        # and -1 only for a single term whose holders include all of D_j: at most one per term.
        free = sum(1 for h in terms if any(d <= h for d in needs))
        return k - free, False
    best = math.inf
    for choice in itertools.product(range(kd), repeat=k):
        cost = sum(
            _group_cost(tuple(h for h, c in zip(terms, choice) if c == j), d) for j, d in enumerate(needs)
        )
        best = min(best, cost)
    return int(best), True


def lower_bound(src, dst, itemsize: int = 4) -> tuple[int, bool]:
    """``(bytes, exact)``: no plan moves fewer bytes than ``bytes``; ``exact`` as in the docstring."""
    src_entries, dst_entries = holders(src), holders(dst)
    dst_partial = _partial(dst)
    total, exact = 0, True
    for element in itertools.product(*(range(n) for n in src.shape)):
        have = _at(src_entries, element)
        need = _at(dst_entries, element)
        if not dst_partial:  # every destination representation wants the same whole value
            frozen = tuple(sorted((r, tuple(sorted(t.values(), key=sorted))) for r, t in have.items()))
            total += _full_value(frozen, frozenset().union(*(d for rep in need.values() for d in rep.values())))
            continue
        costs = []
        for rep in sorted(need):
            needs = tuple(need[rep][t] for t in sorted(need[rep]))
            options = [_split(tuple(terms[t] for t in sorted(terms)), needs) for terms in have.values()]
            cost, ok = min(options)
            costs.append(cost)
            exact = exact and ok
        # several Partial destination representations may share messages: only the largest is a bound
        total += max(costs)
        exact = exact and len(costs) == 1
    return total * itemsize, exact
