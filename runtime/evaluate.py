"""A forward-only iteration of one rank's program (held-out loss): Pull, then every micro-batch's
forward in order with activations sent to the next stage; no gradients, no Push, no optimizer step.

Works for any compiled strategy: the stage programs are the training ones, run under
``torch.no_grad``; pipeline stages exchange a shape header, then the activations (as in 1F1B).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hgraph.runtime.kernels.context import current
from hgraph.schedule.actions import pipeline_peers
from hgraph.errors import InputError
from hgraph.program.rank_program import RankProgram
from hgraph.runtime.executor import pull_parameters
from hgraph.runtime.stage import HEADER, from_header, send_header, shards_device
from hgraph.runtime.kernels.failures import comm_step


def forward_iteration(program: RankProgram, shards: dict[str, torch.Tensor],
                      micro_batches: Sequence[dict[str, torch.Tensor]]) -> float:
    """This rank's summed token loss over ``micro_batches`` (0 on ranks that do not report it)."""
    if program.vpp > 1:
        raise InputError(f"evaluation of an interleaved pipeline (vpp={program.vpp}) is not supported yet; "
                         "evaluate under a strategy with vpp=1")
    comm = current().comm
    sg = program.stage_graph
    device = shards_device(shards)
    peer = pipeline_peers(program.groups["pipeline"], program.pp, program.rank)
    prev_rank = peer(program.stage - 1) if program.stage > 0 else None
    next_rank = peer(program.stage + 1) if program.stage < program.pp - 1 else None
    total = 0.0
    with torch.no_grad():
        params = pull_parameters(program, shards)
        param_args = [params[program.param_of_placeholder[name]] for name in sg.params]
        for mb, batch in enumerate(micro_batches):
            received: list[torch.Tensor] = []
            if prev_rank is not None:
                with comm_step(program.rank, f"eval: receive micro-batch {mb} from rank {prev_rank}"):
                    headers = [(prev_rank, torch.zeros(HEADER, dtype=torch.int64, device=device)) for _ in sg.recv]
                    comm.exchange([], headers)
                    received = [from_header(h) for _, h in headers]
                    comm.exchange([], [(prev_rank, b) for b in received])
            outs = sg.gm(*param_args, *[batch[name] for name in sg.inputs], *received)
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            if sg.returns_loss:
                total += float(outs[0])
                outs = outs[1:]
            if next_rank is not None:
                with comm_step(program.rank, f"eval: send micro-batch {mb} to rank {next_rank}"):
                    comm.exchange([(next_rank, send_header(t)) for t in outs], [])
                    comm.exchange([(next_rank, t.contiguous()) for t in outs], [])
    return total if program.reports_loss else 0.0
