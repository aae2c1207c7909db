"""Several nodes on one machine: two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
127.0.0.1), each with a node-local compile cache of its own, as two machines would be.

* 3 iterations (one per strategy) equal single-process ``torch.optim.AdamW`` on the unmodified model;
* every TP group lies inside one node (the ranks of a group report the same ``GROUP_RANK``);
* ``LOCAL_RANK`` is the rank within the node, and global ranks are node-major;
* each node's cache holds its own ranks' plans only; a second run finds them on every rank.
"""

import json
import sys

import pytest
import torch

from adamw_oracle import single_process_adamw
from long_run_tools import ROOT, TORCHRUN, env, finish, free_port, running

sys.path.insert(0, str(ROOT / "tests" / "runtime"))
import multinode_worker as worker  # noqa: E402

WORKER = str(ROOT / "tests" / "runtime" / "multinode_worker.py")


def two_nodes(tmp, out, tag):
    """Start both agents, wait for both; returns what every rank wrote."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with running([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hgraph-{tag}", WORKER, str(out)],
                 tmp / f"{tag}-a.log", env=env(HGRAPH_COMPILE_CACHE=str(tmp / "node-a" / "compile"),
                                               HGRAPH_CACHE=str(tmp / "node-a" / "cache"))) as a, \
         running([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hgraph-{tag}", WORKER, str(out)],
                 tmp / f"{tag}-b.log", env=env(HGRAPH_COMPILE_CACHE=str(tmp / "node-b" / "compile"),
                                               HGRAPH_CACHE=str(tmp / "node-b" / "cache"))) as b:
        procs = [(a, tmp / f"{tag}-a.log"), (b, tmp / f"{tag}-b.log")]
        for proc, log in procs:
            text = finish(proc, log, 600)
            assert proc.returncode == 0, text[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_torchrun_agents_train_like_one_process_with_tp_inside_nodes_and_node_local_caches(tmp_path):
    ranks = two_nodes(tmp_path, tmp_path / "first", "first")
    node = {r["rank"]: int(r["env"]["GROUP_RANK"]) for r in ranks}
    assert sorted(node.values()) == [0, 0, 1, 1]
    for r in ranks:
        assert r["world"] == 4 and r["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert int(r["env"]["LOCAL_RANK"]) == r["rank"] - 2 * node[r["rank"]]  # node-major global ranks
        assert r["device_index"] == int(r["env"]["LOCAL_RANK"])  # a node's GPUs are indexed locally
        for group in r["tp_groups"]:
            assert r["rank"] in group and len({node[m] for m in group}) == 1, (r["rank"], group)  # inside a node
    assert {len(g) for r in ranks for g in r["tp_groups"]} == {1, 2}  # tp2 groups (and the tp1 of 2x tp1)
    # node-local caches: each node's directory holds the plans of its own two ranks, nobody else's
    by_dir = {}
    for r in ranks:
        by_dir.setdefault(r["cache_dir"], set()).add(node[r["rank"]])
        assert not r["cache_hit"]
    assert len(by_dir) == 2 and all(len(nodes) == 1 for nodes in by_dir.values())
    assert all(len(r["cache_entries"]) == 2 for r in ranks)

    # the oracle: the unmodified model, one process, torch.optim.AdamW, the same 3 global batches
    reference = single_process_adamw(worker.make_model(), worker.make_batches(), **worker.OPT)
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
    params = torch.load(tmp_path / "first" / "params.pt")
    for it, (got, want) in enumerate(zip(params, reference.params)):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"iter {it} {name}: {m}")

    again = two_nodes(tmp_path, tmp_path / "second", "second")  # same nodes, warm caches
    first_dir = {r["rank"]: r["cache_dir"] for r in ranks}
    for r in again:  # a rank finds its plans where it ran before (the rendezvous orders agents by pid)
        assert r["cache_hit"] == (r["cache_dir"] == first_dir[r["rank"]])
    assert any(r["cache_hit"] for r in again)
    assert [r["losses"] for r in again] == [r["losses"] for r in ranks]
