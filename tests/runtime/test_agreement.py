"""The start-up check that every rank holds the same model covers every buffer dtype: floating tensors
by statistics (up to summation order), integer and bool tensors (GPT-BigCode's causal mask) exactly."""

import pytest
import torch

from hgraph.errors import TrainingError
from hgraph.runtime.agreement import check_same_parameters
from hgraph.runtime.kernels.thread_comm import run_threads


def tensors(rank, change=None):
    g = torch.Generator().manual_seed(0)
    out = {
        "weight": torch.randn(8, 4, generator=g),
        "causal_mask": torch.ones(16, 16, dtype=torch.bool).tril(),
        "positions": torch.arange(1000, dtype=torch.int64) * 1000,
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
    }
    if change is not None and rank == 1:
        change(out)
    return out


def check(change=None):
    run_threads(lambda comm: check_same_parameters(tensors(comm.rank, change), comm, (0, 1), torch.device("cpu")),
                2, timeout=30)


def test_equal_models_of_every_buffer_dtype_agree():
    check()


def flip_mask(t):
    t["causal_mask"][3, 9] = True


def swap_positions(t):  # same sum, norm and sampled elements: only the bytes tell
    t["positions"][[1, 2]] = t["positions"][[2, 1]]


@pytest.mark.parametrize("change, name", [(flip_mask, "causal_mask"), (swap_positions, "positions")])
def test_integer_and_bool_buffers_are_compared_exactly(change, name):
    with pytest.raises(TrainingError, match=rf"rank 1 holds a different model than rank 0: '{name}' differs "
                                            r"\(its bytes differ\)"):
        check(change)
