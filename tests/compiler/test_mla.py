"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash's ``Glm4MoeLite``) sharded as Megatron-Core
shards it: the low-rank down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms
duplicated on every tp rank, the up-projections (``q_b_proj``, ``kv_b_proj``) column-parallel over heads,
the shared rope key expanded to each rank's own heads, ``o_proj`` row-parallel.

The bytes each attention layer moves are counted in the compiled program and compared with the
head-sharded minimum computed from the config alone: forward, the all-reduce of ``o_proj``'s output
``[b, s, hidden]``; backward, the sums of the gradients of what every rank computes whole and then
feeds into its heads — the query latent ``[b, s, q_lora_rank]``, the key/value latent
``[b, s, kv_lora_rank]`` and the rope key ``[b, s, qk_rope_head_dim]``. Nothing gathers full heads.
(Equality with the unmodified model on every strategy is the zoo's test.)"""

from __future__ import annotations

import pytest
import torch

import hgraph
from hgraph.core.placement import Replicate, Shard
from hgraph.models.zoo import zoo_model

EXAMPLE = (2, 8)
NETWORK = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "grad_all_reduce"}  # split moves nothing


def attention_traffic(compiled, model) -> dict[str, dict[str, int]]:
    """Per attention module: bytes per rank moved forward and backward, and the collectives used."""
    modules = {}
    for node in compiled.traced.graph_module.graph.nodes:
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        path = stack[-1][0] if stack else ""
        if ".self_attn" in path:
            modules[node.name] = path[: path.index(".self_attn") + len(".self_attn")]
    traffic: dict[str, dict[str, int]] = {}
    for node in compiled.local_program(1, 2).graph.nodes:
        comm = node.meta.get("hgraph_comm")
        if not comm or comm["tensor"] not in modules or comm["op"] not in NETWORK:
            continue
        entry = traffic.setdefault(modules[comm["tensor"]], {"forward": 0, "backward": 0})
        entry[comm["direction"]] += comm["bytes"]
        entry[comm["op"]] = entry.get(comm["op"], 0) + 1
    return traffic


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("glm4_moe_lite", marks=pytest.mark.slow)])
def test_mla_moves_the_head_sharded_minimum(family):
    model = zoo_model(family).eval()
    config = model.config
    compiled = hgraph.compile(model, ["tp2"], example_inputs=torch.randint(0, 256, EXAMPLE))
    tokens, item = EXAMPLE[0] * EXAMPLE[1], 4
    forward = tokens * config.hidden_size * item
    backward = tokens * (config.q_lora_rank + config.kv_lora_rank + config.qk_rope_head_dim) * item
    traffic = attention_traffic(compiled, model)
    assert len(traffic) == config.num_hidden_layers
    for module, entry in traffic.items():
        assert entry == {"forward": forward, "backward": backward, "all_reduce": 1, "grad_all_reduce": 3}, module


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("glm4_moe_lite", marks=pytest.mark.slow)])
def test_mla_weights_are_duplicated_down_and_head_parallel_up(family):
    model = zoo_model(family).eval()
    compiled = hgraph.compile(model, ["tp2"], example_inputs=torch.randint(0, 256, EXAMPLE))
    pulls = {sg.tensor: sg.dst.placements[-1] for sg in compiled.subgraphs(0, 0)
             if sg.kind == "pull_parameter"}
    attention = "model.layers.0.self_attn."
    assert pulls[attention + "q_a_proj.weight"] == Replicate()
    assert pulls[attention + "kv_a_proj_with_mqa.weight"] == Replicate()
    assert pulls[attention + "q_b_proj.weight"] == Shard(0)  # heads
    assert pulls[attention + "kv_b_proj.weight"] == Shard(0)
    assert pulls[attention + "o_proj.weight"] == Shard(1)
