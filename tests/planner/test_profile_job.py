"""Profiling on a job's own ranks (``hgraph.profiling.profile_job``) on two real gloo ranks: every rank
gets rank 0's profile, measured once on all ranks when rank 0's cache lacks it, read when it has it,
whatever the other ranks' caches hold; a profile that cannot run fails on every rank alike; outside a
process group it is refused."""

import json
import logging
import os

import pytest

from hgraph.core.degrees import Degrees
from hgraph.errors import CostModelError
from hgraph.models import Llama, LlamaConfig
from hgraph.profiling.profile_job import profile_job
from hgraph.runtime.launch import launch

SCHEMES = [Degrees.parse("tp1"), Degrees.parse("tp2")]


def tiny_llama():
    return Llama(LlamaConfig(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))


def _profile_with_cache_per_rank(caches: list[str], requests: list[list[int]]) -> list[dict]:
    """On each rank: its own ``$HGRAPH_CACHE`` (``caches[rank]``), then ``profile_job`` at each
    request's lengths, in turn; what it said and what its logger recorded."""
    import torch.distributed as dist

    os.environ["HGRAPH_CACHE"] = caches[dist.get_rank()]
    logger = logging.getLogger("hgraph.profiling.profile_job")
    out = []
    for lengths in requests:
        said: list[str] = []
        records = _Records()
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
        try:
            profile = profile_job(tiny_llama, SCHEMES, lengths, repeats=1, memory_gb=0.05, say=said.append)
        except CostModelError as exc:
            out.append({"error": str(exc)})
            continue
        finally:
            logger.removeHandler(records)
        out.append({"table": json.dumps(profile.cost_model.to_table()), "cached": profile.cached, "said": said,
                    "logged": records.messages})
    return out


class _Records(logging.Handler):
    """The messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _entries(folder):
    return sorted(p.name for p in (folder / "profile").iterdir()) if (folder / "profile").exists() else []


@pytest.mark.slow  # two launches of two ranks, one profile (about a minute here)
def test_every_rank_plans_with_rank_0s_profile_measured_once_then_read(tmp_path):
    first, second, third = (tmp_path / name for name in ("rank0", "rank1", "rank1-again"))
    [bad, ran] = zip(*launch(_profile_with_cache_per_rank, 2, args=([str(first), str(second)], [[16, 32], [16, 32, 64]]),
                             timeout=600))
    assert all("lengths [16, 32]: need at least 3 distinct lengths" in r["error"] for r in bad), bad  # every rank
    assert ran[0]["table"] == ran[1]["table"] and not ran[0]["cached"] and not ran[1]["cached"]
    assert ran[0]["said"][0].startswith("profiling T(l) on this job's 2 ranks (cpu): schemes tp1, tp2")
    assert ran[0]["said"][1].startswith("profiled in ") and ran[1]["said"] == []  # from rank 0 only
    assert any(m.startswith("round 1/1 measured") for m in ran[0]["logged"]) and ran[1]["logged"] == []
    assert len(_entries(first)) == 1 and _entries(second) == []  # rank 0 caches
    # rank 0 has the profile, rank 1's cache is empty: both read rank 0's, nobody measures
    [again] = zip(*launch(_profile_with_cache_per_rank, 2, args=([str(first), str(third)], [[16, 32, 64]]), timeout=600))
    assert [r["table"] for r in again] == [ran[0]["table"]] * 2 and all(r["cached"] for r in again)
    assert again[0]["said"] == [] and _entries(third) == []


def test_profiling_on_the_jobs_ranks_needs_its_process_group():
    with pytest.raises(CostModelError, match="needs its torch.distributed group"):
        profile_job(tiny_llama, SCHEMES, [16, 32, 64])  # no process group in this process
