"""Packing one pipeline's sequences into micro-batches, minimising its true 1F1B time.

With ``V`` micro-batches of sequence work ``C_1..C_V`` the pipeline takes
``W + V·c + (pp − 1)·(max C + c)`` (``W``: the sequences' total work), so:

* ``pp == 1``: only the number of micro-batches matters; pack into as few as fit in MaxLen
  (first-fit decreasing).
* ``pp > 1``: more micro-batches add ``c`` each but shrink the bubble ``(pp − 1)·max C``. ``V`` is
  searched from the minimiser of the convex lower bound ``V·c + (pp − 1)·max(t_max, W/V)`` outwards,
  stopping once the bound cannot beat the best packing found; each ``V`` is packed by LPT under the
  token cap, then improved by moves and swaps out of the heaviest micro-batch.
"""

from __future__ import annotations

import math
from typing import Sequence

from hgraph.errors import PlanError
from hgraph.planner.timing import PipelineCost

Packing = list[list[int]]  # micro-batches as positions into the packed list


def pack(cost: PipelineCost, lengths: Sequence[int]) -> tuple[Packing, float]:
    """Micro-batches (positions into ``lengths``) and the pipeline time (ms) they give."""
    n = len(lengths)
    if n == 0:
        return [], 0.0
    longest = max(lengths)
    if longest > cost.max_len:
        raise PlanError(f"sequence of {longest} tokens exceeds this pipeline's MaxLen {cost.max_len}")
    order = sorted(range(n), key=lambda i: -lengths[i])
    times = [cost.seq_time(l) for l in lengths]
    work = sum(times)
    if cost.pp == 1:
        bins = first_fit_decreasing(lengths, order, cost.max_len)
        return bins, work + len(bins) * cost.c
    bubble = cost.pp - 1
    t_max = times[order[0]]
    v_min = max(1, math.ceil(sum(lengths) / cost.max_len))

    def bound(v: int) -> float:
        return v * cost.c + bubble * max(t_max, work / v)

    best: tuple[float, Packing] = (math.inf, [])
    for v in _by_bound(bound, v_min, n):
        if work + bubble * cost.c + bound(v) >= best[0] - 1e-9:
            break
        bins = balanced_bins(lengths, times, order, v, cost.max_len)
        if bins is None:
            continue
        c_max = max(sum(times[i] for i in b) for b in bins)
        total = work + len(bins) * cost.c + bubble * (c_max + cost.c)
        if total < best[0]:
            best = (total, bins)
    return best[1], best[0]


def _by_bound(bound, lo: int, hi: int):
    """Integers of [lo, hi] in ascending order of a convex ``bound`` (two pointers from its minimum)."""
    left, right = lo, hi
    while right - left > 2:  # ternary search for the minimiser of the convex bound
        m1 = left + (right - left) // 3
        m2 = right - (right - left) // 3
        if bound(m1) <= bound(m2):
            right = m2
        else:
            left = m1
    start = min(range(left, right + 1), key=bound)
    yield start
    down, up = start - 1, start + 1
    while down >= lo or up <= hi:
        if up > hi or (down >= lo and bound(down) <= bound(up)):
            yield down
            down -= 1
        else:
            yield up
            up += 1


def first_fit_decreasing(lengths: Sequence[int], order: Sequence[int], cap: int) -> Packing:
    """Bin packing by first-fit decreasing: few micro-batches of at most ``cap`` tokens."""
    bins: Packing = []
    room: list[int] = []
    for i in order:
        l = lengths[i]
        for k, r in enumerate(room):
            if l <= r:
                bins[k].append(i)
                room[k] -= l
                break
        else:
            bins.append([i])
            room.append(cap - l)
    return bins


def balanced_bins(
    lengths: Sequence[int], times: Sequence[float], order: Sequence[int], v: int, cap: int
) -> Packing | None:
    """``v`` micro-batches with the smallest heaviest one we can find, each within ``cap`` tokens;
    None when LPT cannot fit the sequences into ``v``."""
    load = [0.0] * v
    room = [cap] * v
    bins: Packing = [[] for _ in range(v)]
    for i in order:
        l = lengths[i]
        k = -1
        for j in range(v):
            if room[j] >= l and (k < 0 or load[j] < load[k]):
                k = j
        if k < 0:
            return None
        bins[k].append(i)
        load[k] += times[i]
        room[k] -= l
    _improve(bins, load, room, lengths, times)
    return [b for b in bins if b]


def _improve(bins: Packing, load: list[float], room: list[int], lengths, times, rounds: int = 64) -> None:
    """Moves and swaps out of the heaviest bin while they lower the heavier of the two bins."""
    v = len(bins)
    for _ in range(rounds):
        h = max(range(v), key=load.__getitem__)
        top = load[h]
        best = (top - 1e-9, None)
        for j in range(v):
            if j == h:
                continue
            for i in bins[h]:
                ti, li = times[i], lengths[i]
                if li <= room[j]:
                    new = max(top - ti, load[j] + ti)
                    if new < best[0]:
                        best = (new, (j, i, None))
                for r in bins[j]:
                    d = ti - times[r]
                    if d > 0 and li - lengths[r] <= room[j] and lengths[r] - li <= room[h]:
                        new = max(top - d, load[j] + d)
                        if new < best[0]:
                            best = (new, (j, i, r))
        if best[1] is None:
            return
        j, i, r = best[1]
        bins[h].remove(i)
        bins[j].append(i)
        load[h] -= times[i]
        load[j] += times[i]
        room[h] += lengths[i]
        room[j] -= lengths[i]
        if r is not None:
            bins[j].remove(r)
            bins[h].append(r)
            load[h] += times[r]
            load[j] -= times[r]
            room[h] -= lengths[r]
            room[j] += lengths[r]
