"""The model zoo: HuggingFace causal LMs exactly as ``AutoModelForCausalLM.from_config`` builds them from
each family's default config (only sizes shrunk; ``hgraph.models.zoo``), compiled for every strategy kind on
world 4, ``simulate`` equal to the unmodified model — loss and every gradient, fp32, rtol 1e-5 — on
24-token sequences (longer than the 8-token example and than the 8-token sliding windows).

``EXPECTED`` is the supported-models table: ``equal``, or the refusal (a regex of the HGraphError) a
(family, strategy) must raise. A silent mismatch fails whatever the table says.
"""

from __future__ import annotations

import re

import pytest
import torch

import hgraph
from hgraph.cli.zoo_check import STRATEGY_KINDS, check_family
from hgraph.models.zoo import zoo_model

TP_DP, TP_PP, DP_PP, CP = STRATEGY_KINDS.values()
EQUAL = "equal"
# Mixture of experts: routing (topk, sort, histc) is replicated and needs every routed token, which
# context parallelism splits: refused, naming the op.
MOE_CP = r"(context parallelism|sharded tokens|cp-split tokens|cp)"
# ALiBi attention (Bloom, MPT) keeps its dense bias and mask, computed across the whole sequence, and
# OPT derives positions from a cumulative sum over the sequence: context parallelism is refused,
# naming the op and the module.
EAGER_CP = r"(context parallelism|sharded tokens|cp-split tokens)"

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
    "opt": {CP: EAGER_CP},
    "falcon": {},
    "bloom": {CP: EAGER_CP},
    "stablelm": {},
    "mixtral": {CP: MOE_CP},
    "qwen2_moe": {CP: MOE_CP},
    # beyond the sixteen (run with the slow tests)
    "gemma3": {},
    "starcoder2": {},
    "gptj": {},
    "mpt": {CP: EAGER_CP},
    "gpt_bigcode": {},
    "cohere": {},
    "olmo2": {},
}
SLOW = {"gemma3", "starcoder2", "gptj", "mpt", "gpt_bigcode", "cohere", "olmo2"}


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in EXPECTED]
)
def test_family_in_its_default_config(family):
    results = check_family(family)
    assert [r.strategy for r in results] == list(STRATEGY_KINDS.values())
    for result in results:
        expected = EXPECTED[family].get(result.strategy, EQUAL)
        assert result.status != "wrong", f"silently wrong: {result}"
        if expected == EQUAL:
            assert result.status == "equal", str(result)
        else:
            assert result.status == "error" and re.search(expected, result.detail), str(result)


def test_dropout_of_a_default_config_is_refused_with_the_fix():
    """GPT-2's defaults have dropout 0.1 and ``from_config`` returns train mode: refused, naming the module
    and ``model.eval()``."""
    model = zoo_model("gpt2")
    assert model.training
    with pytest.raises(hgraph.HGraphError, match=r"GPT2LMHeadModel module 'transformer\.drop'.*model\.eval\(\)"):
        hgraph.compile(model, [TP_DP], example_inputs=torch.randint(0, 256, (2, 8)))
