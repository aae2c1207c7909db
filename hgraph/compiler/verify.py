"""Verification before anything runs: the action lists of every rank of a strategy dry-run together.

``check_actions`` builds every rank's program (``RankProgram.actions``: the blocking list, or the
overlap lowering) and runs them against each other (``hgraph.schedule.replay.dry_run``); a deadlock
or a mismatched order raises ``ScheduleError`` naming the rank, the action and the peer. The
compiler calls it at compile (with ``verify``) for the new lowerings and typical overlap dispatches;
the Trainer for each real dispatch under ``schedule="overlap"``.
"""

from __future__ import annotations

from typing import Sequence

from hgraph.program.rank_program import CompiledPrograms
from hgraph.runtime.kernels.reshard import late_peers
from hgraph.schedule.actions import Kind, wrapped_chunk
from hgraph.schedule.replay import dry_run


def check_actions(compiled: CompiledPrograms, index: int, micro_batches: Sequence[int], mode: str = "train") -> None:
    """Dry-run the action lists (``RankProgram.actions(m, mode)``: ``"train"`` or ``"eval"``) of every
    rank of strategy ``index`` with ``micro_batches[p]`` micro-batches on pipeline ``p``; raises
    ``ScheduleError`` on a deadlock or a mismatched order."""
    programs = {r: compiled.program(index, r) for r in range(compiled.world_size)}
    bucket_ranks = {(r, pc.name): pc.pull.plan.ranks for r, p in programs.items() for pc in p.pulls}
    bucket_ranks.update({(r, pc.name): pc.push.plan.ranks for r, p in programs.items() for pc in p.pushes})
    late = {(r, kind, pc.name): late_peers(plan, r) for r, p in programs.items()
            for kind, pcs in ((Kind.PULL_WAIT, p.pulls), (Kind.PUSH_WAIT, p.pushes))
            for pc in pcs for plan in [pc.pull.plan if kind is Kind.PULL_WAIT else pc.push.plan]}
    dry_run(
        {r: p.actions(micro_batches[p.pipeline], mode) for r, p in programs.items()},
        members=lambda r, group: bucket_ranks[(r, group)],
        first=lambda r, c: programs[r].stage == 0 and c == 0,
        last=lambda r, c: programs[r].is_last_stage and c == programs[r].vpp - 1,
        route=lambda r, a: wrapped_chunk(programs[r].pp, programs[r].stage, a),
        late=lambda r, a: late[(r, a.kind, a.group)],
    )


def typical_dispatches(pipelines: int) -> list[list[int]]:
    """Micro-batch counts per pipeline the compile-time overlap check covers (the Trainer checks each
    real dispatch): 1, 2 and 3 on every pipeline, and 2 with the last pipeline idle."""
    n = pipelines
    return [[1] * n, [2] * n, [3] * n, [2] * (n - 1) + [0]]
