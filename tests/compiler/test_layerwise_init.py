"""The contract of ``hgraph.frontend.layerwise_init.initialize``: on a model built on meta, every parameter gets,
bit for bit, what the model's own scheme gives the same model materialised whole in one process
(``to_empty``, re-tie, ``torch.manual_seed(seed)``, HF ``initialize_weights()`` / every module's
``reset_parameters()``), while never more than one layer's parameters exist at once."""

import pytest
import torch
import transformers
from torch import nn

from hgraph.errors import InputError
from hgraph.frontend.layerwise_init import initialize
from hgraph.frontend.meta import materialize_buffers
from hgraph.models import Llama, LlamaConfig


def hf_llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2)).eval()


def hf_gpt2() -> nn.Module:  # tied embeddings; each block re-initialises its children's c_proj
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)).eval()


def hf_qwen2_tied() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)).eval()


def own_llama() -> nn.Module:  # plain torch modules: reset_parameters()
    return Llama(LlamaConfig(layers=3, kv_heads=4, tie_embeddings=True), seed=None)


def reference(build, seed: int) -> dict[str, torch.Tensor]:
    """The contract's right-hand side: the same model materialised whole, then its own scheme."""
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")  # unties: tie again, as the meta model is tied
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    elif model.config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    torch.manual_seed(seed)
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()
    else:
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
    return dict(model.named_parameters())


def layer_sizes(model: nn.Module) -> int:
    """Elements of the largest layer: a ``layers.<i>`` / ``h.<i>`` block, or a top-level parameter."""
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = next((".".join(parts[: i + 2]) for i, part in enumerate(parts) if part in ("layers", "h")), name)
        sizes[key] = sizes.get(key, 0) + p.numel()
    return max(sizes.values())


@pytest.mark.parametrize("build", [hf_llama, hf_gpt2, hf_qwen2_tied, own_llama],
                         ids=["hf_llama", "hf_gpt2", "hf_qwen2_tied", "own_llama"])
def test_layerwise_init_is_the_models_own_scheme_bit_for_bit(build):
    with torch.device("meta"):
        model = build()
    materialize_buffers(model)
    got, live = {}, []

    def ready(name, value):
        live.append(sum(p.numel() for p in model.parameters() if not p.is_meta) + value.numel())
        got[name] = value.clone()

    before = torch.get_rng_state()
    initialize(model, 7, ready)
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is untouched
    want = reference(build, 7)
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert all(p.is_meta for p in model.parameters())  # nothing left materialised
    assert max(live) <= layer_sizes(model)  # at most one layer in full at any time
    other = {}
    initialize(model, 8, lambda n, v: other.__setitem__(n, v))
    assert any(not torch.equal(other[n], got[n]) for n in got if got[n].std() > 0)  # the seed matters


def test_not_the_values_eager_construction_leaves():
    """Stated plainly in the contract: eager from_config draws at construction first, so its values
    differ (same distributions)."""
    with torch.device("meta"):
        model = hf_llama()
    got = {}
    initialize(model, 0, lambda n, v: got.__setitem__(n, v))
    torch.manual_seed(0)
    eager = dict(hf_llama().named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], eager[q])
    assert got[q].std().item() == pytest.approx(eager[q].std().item(), rel=0.1)


class _Unscheduled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))  # no reset_parameters writes it
        self.proj = nn.Linear(4, 4)


def test_a_parameter_no_scheme_writes_raises():
    with torch.device("meta"):
        model = _Unscheduled()
    with pytest.raises(InputError, match=r"parameter 'scale' .*not written by _Unscheduled's own initialisation"):
        initialize(model, 0, lambda n, v: None)
    assert all(p.is_meta for p in model.parameters())


def test_thread_ranks_initialising_one_meta_model_at_once_each_get_every_parameter():
    """Simulated ranks are threads sharing one model: one rank's walk swaps live tensors into the
    module slots while another starts; each must still see the model as built (regression: the
    second read a half-swapped model, missed its live parameters and raised a raw KeyError)."""
    import sys
    import threading
    import time

    with torch.device("meta"):
        model = hf_llama()
    names = [fqn for fqn, _ in model.named_parameters()]
    got: list[list[str]] = [[], [], [], []]
    start = threading.Barrier(len(got))

    def rank(i: int) -> None:
        start.wait()
        for k in range(5):
            time.sleep(0.003 * ((i * 7 + k * 3) % 10))  # start at varied points of another rank's walk
            initialize(model, i, lambda fqn, value: got[i].append(fqn))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(got))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so the walks interleave everywhere they can
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert all(sorted(g) == sorted(names * 5) for g in got)
    assert all(p.is_meta for p in model.parameters())
