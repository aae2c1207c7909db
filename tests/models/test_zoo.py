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
    "granitemoe": {CP: MOE_CP},
}


# Mixture of experts sorts a micro-batch's tokens by expert: token-local, but not op by op, so the
# packing proof shows it by probing; every other family is proved from its graph. A family that falls
# back to one document per micro-batch (a leak the proof found) fails here even though its losses are
# then right: packing is the point.
PROBED = {"mixtral", "qwen2_moe", "granitemoe"}


def _check(family, strategies):
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


def most_informative(family: str) -> str:
    """cp where the family supports it (packed documents cut into chunks), else tp x pp."""
    return CP if CP not in EXPECTED[family] else TP_PP


def test_every_family_is_in_the_table():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_packed_on_its_most_informative_strategy(family):
    _check(family, [most_informative(family)])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_packed_on_every_strategy_kind(family):
    _check(family, list(STRATEGY_KINDS.values()))


def test_dropout_of_a_default_config_is_refused_with_the_fix():
    """GPT-2's defaults have dropout 0.1 and ``from_config`` returns train mode: refused, naming the module
    and ``model.eval()``."""
    model = zoo_model("gpt2")
    assert model.training
    with pytest.raises(hgraph.HGraphError, match=r"GPT2LMHeadModel module 'transformer\.drop'.*model\.eval\(\)"):
        hgraph.compile(model, [TP_DP], example_inputs=torch.randint(0, 256, (2, 8)))
