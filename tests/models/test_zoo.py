"""The model zoo: HuggingFace causal LMs exactly as ``AutoModelForCausalLM.from_config`` builds them from
each family's default config (only sizes shrunk; ``hgraph.models.zoo``), compiled for every strategy kind on
world 4. The batch is documents of different lengths (``hgraph.cli.zoo_check.DOCUMENT_LENGTHS``) that
``simulate`` dispatches and packs as ``Trainer.step`` does — several documents per micro-batch,
positions restarting at each, cp chunks crossing them — and the loss and every gradient must equal
the unmodified model run on each document alone (fp32, rtol 1e-5).

``EXPECTED`` is the supported-models table: ``equal``, or the refusal (a regex of the HGraphError) a
(family, strategy) must raise; ``PROBED``: how the packing proof shows packing exact. A silent
mismatch fails whatever the table says.

Budget: ``make test`` checks every family once, on its most informative strategy kind (cp where the
family supports it: documents cut into load-balanced chunks, K/V gathered across them; else tp x pp:
heads split, micro-batches across stages); the full family x strategy matrix runs with the slow tests.
"""

from __future__ import annotations

import re

import pytest
import torch

import hgraph
from hgraph.cli.zoo_check import STRATEGY_KINDS, check_family
from hgraph.models.zoo import FAMILIES, zoo_model

TP_DP, TP_PP, DP_PP, CP = STRATEGY_KINDS.values()
EQUAL = "equal"
# Mixture of experts: routing (topk, sort, histc) is replicated and needs every routed token, which
# context parallelism splits: refused, naming the op.
MOE_CP = r"(context parallelism|sharded tokens|cp-split tokens|cp)"

# Gated DeltaNet's convolution and delta rule carry a state along the sequence: cp of a recurrence is
# refused, naming the layer.
RECURRENCE_CP = r"carries a state along the sequence.*context parallelism"
# Layers hgraph has no packed kernel for (Mamba's selective scan, MiniMax's lightning attention):
# refused before tracing, naming the module and the construct.
UNSUPPORTED = r"module '.*' \((\w+)\) is a (state-space \(selective scan\)|lightning-attention) layer.*Gated DeltaNet"
EVERY = tuple(STRATEGY_KINDS.values())

EXPECTED: dict[str, dict[str, str]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gemma2": {},
    "phi3": {},
    "phi": {},
    "gpt2": {},
    "gpt_neox": {},
    "opt": {},
    "falcon": {},
    "bloom": {},
    "stablelm": {},
    "mixtral": {CP: MOE_CP},
    "qwen2_moe": {CP: MOE_CP},
    "gemma3": {},
    "starcoder2": {},
    "gptj": {},
    "mpt": {},
    "gpt_bigcode": {},
    "cohere": {},
    "olmo2": {},
    # 2025-2026 families (issue 22)
    "deepseek_v3": {CP: MOE_CP},
    "deepseek_v2": {CP: MOE_CP},
    "glm4_moe_lite": {CP: MOE_CP},
    "glm4_moe": {CP: MOE_CP},
    "dots1": {CP: MOE_CP},
    "qwen3_moe": {CP: MOE_CP},
    "qwen3_next": {CP: RECURRENCE_CP},
    "qwen3_5": {CP: RECURRENCE_CP},
    "qwen3_5_moe": {CP: RECURRENCE_CP},
    "gpt_oss": {CP: MOE_CP},  # attention sinks, sliding/full layers: packed attention (sinks, window)
    "llama4": {CP: MOE_CP},  # chunked and full layers: packed attention (chunk)
    "gemma4": {},
    "olmo3": {},
    "smollm3": {},
    "ministral": {},
    "granite": {},
    "olmoe": {CP: MOE_CP},
    "granitemoe": {CP: MOE_CP},
    "granitemoeshared": {CP: MOE_CP},
    "phimoe": {CP: MOE_CP},
    "ernie4_5_moe": {CP: MOE_CP},
    "hunyuan_v1_moe": {CP: MOE_CP},
    "helium": {},
    "glm4": {},
    "glm": {},
    "exaone4": {},
    "seed_oss": {},
    "ernie4_5": {},
    "cohere2": {},
    "hunyuan_v1_dense": {},
    "apertus": {},
    "arcee": {},
    "lfm2": {},
    "minimax": dict.fromkeys(EVERY, UNSUPPORTED),
    "falcon_h1": dict.fromkeys(EVERY, UNSUPPORTED),
    "nemotron_h": dict.fromkeys(EVERY, UNSUPPORTED),
}
ONCE = {family: CP if CP not in expected else TP_PP for family, expected in EXPECTED.items()}
"""The strategy ``make test`` checks each family on: cp where the family allows it, else tp x pp."""


# How the packing proof shows packing exact, where not from the graph: mixtures of experts sort a
# micro-batch's tokens by expert (token-local, but not op by op), and Gated DeltaNet's per-document
# recurrence refuses the cp localization the graph proof uses; the probe shows both. A family that
# falls back to one document per micro-batch (a leak the proof found) fails here even though its
# losses are then right: packing is the point.
PROBED = {family for family, expected in EXPECTED.items() if expected.get(CP) in (MOE_CP, RECURRENCE_CP)}


def check(family: str, strategies) -> None:
    results = check_family(family, strategies)
    assert [r.strategy for r in results] == list(strategies)
    for result in results:
        if result.status != "error":
            assert result.packing == f"packed ({'probe' if family in PROBED else 'graph'})", str(result)
        expected = EXPECTED[family].get(result.strategy, EQUAL)
        assert result.status != "wrong", f"silently wrong: {result}"
        if expected == EQUAL:
            assert result.status == "equal", str(result)
        else:
            assert result.status == "error" and re.search(expected, result.detail), str(result)


def test_every_family_is_in_the_table():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_once(family):
    """Every family, packed, on one strategy (cp where allowed, else tp x pp): the default run."""
    check(family, [ONCE[family]])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_in_its_default_config(family):
    """Every family, packed, on every strategy kind: equal, or the refusal ``EXPECTED`` names."""
    check(family, list(STRATEGY_KINDS.values()))


def test_dropout_of_a_default_config_is_refused_with_the_fix():
    """GPT-2's defaults have dropout 0.1 and ``from_config`` returns train mode: refused, naming the module
    and ``model.eval()``."""
    model = zoo_model("gpt2")
    assert model.training
    with pytest.raises(hgraph.HGraphError, match=r"GPT2LMHeadModel module 'transformer\.drop'.*model\.eval\(\)"):
        hgraph.compile(model, [TP_DP], example_inputs=torch.randint(0, 256, (2, 8)))
