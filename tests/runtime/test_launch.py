"""The local launcher: results in rank order, errors named by rank, no hangs."""

import pytest

from hgraph.errors import CommunicationError
from hgraph.runtime.launch import init_from_env, launch


def _rank_and_sum(offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() + offset, dist.get_world_size(), t.item(), torch.get_num_threads()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return "ok"


def _hang_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    return "never"


def test_results_come_back_in_rank_order():
    assert launch(_rank_and_sum, 2, args=(10,)) == [(10, 2, 1.0, 1), (11, 2, 1.0, 1)]


def test_failure_names_the_rank_and_its_error():
    with pytest.raises(CommunicationError, match=r"rank 1 failed: ValueError: boom on purpose"):
        launch(_fail_on_rank_one, 2, timeout=60)


def test_timeout_instead_of_hang():
    with pytest.raises(CommunicationError, match=r"did not finish within 8s|rank 0 failed"):
        launch(_hang_on_rank_zero, 2, timeout=8)


def test_init_from_env_needs_torchrun_variables(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(CommunicationError, match="RANK"):
        init_from_env()
