"""Compiling a model built on the meta device (``with torch.device("meta"):``): the same programs as the
eagerly built model, construction-time buffers recomputed by the model's own scheme, no storage."""

import pytest
import torch
import transformers
from torch import nn

import hgraph
from hgraph.errors import InputError
from hgraph.models import Llama, LlamaConfig
from hgraph.program.options import OverlapConfig

IDS = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))


def hf_llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=5e5)).eval()


def hf_gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0)).eval()


def hf_neox() -> nn.Module:  # partial rotary (rotary_pct), fused qkv, biases
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        rotary_pct=0.5, max_position_embeddings=512, bos_token_id=0, eos_token_id=0)).eval()


def own_llama() -> nn.Module:
    return Llama(LlamaConfig(layers=2, kv_heads=4), seed=None)


def built(build, meta: bool) -> nn.Module:
    if meta:
        with torch.device("meta"):
            return build()
    torch.manual_seed(0)
    return build()


def programs(compiled) -> list[str]:
    """Everything a compile produces, as text: per strategy and rank the explain output (compute,
    pulls, pushes, activations, layouts, bytes), the action list, and the stage programs' code."""
    out = [str(lay) for lay in compiled.optimizer_layouts.values()]
    for i in range(len(compiled.strategies)):
        for rank in range(compiled.world_size):
            program = compiled.program(i, rank)
            out.append(compiled.explain(i, rank, backward=False))
            out.append(" ".join(map(str, program.actions(3))))
            out += [chunk.gm.code for chunk in program.chunk_graphs]
            out += [str(pc.pull.plan) + str(pc.push.plan) for pc in program.pulls]
    return out


@pytest.mark.parametrize("build", [hf_llama, hf_gpt2, own_llama], ids=["hf_llama", "hf_gpt2", "own_llama"])
def test_meta_and_eager_compiles_give_identical_programs(build):
    strategies = ["2x tp1", "tp2", "tp1,pp2"]
    eager = hgraph.compile(built(build, False), strategies, example_inputs=IDS,
                           options=hgraph.CompileOptions(build=hgraph.BuildConfig(rank=None)))
    meta_model = built(build, True)
    meta = hgraph.compile(meta_model, strategies, example_inputs=IDS,
                          options=hgraph.CompileOptions(build=hgraph.BuildConfig(rank=None)))
    assert programs(meta) == programs(eager)
    assert str(meta.traced) == str(eager.traced)
    assert all(p.is_meta for p in meta.model.parameters())  # compiling allocated no parameter


def test_meta_and_eager_give_identical_programs_with_cp_and_overlap():
    strategies = ["tp2,cp2", "tp2,pp2"]
    options = dict(example_inputs=IDS,
                   options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig()),
                                                 build=hgraph.BuildConfig(rank=None)))
    eager = hgraph.compile(built(hf_llama, False), strategies, **options)
    meta = hgraph.compile(built(hf_llama, True), strategies, **options)
    assert programs(meta) == programs(eager)


@pytest.mark.parametrize("build", [hf_llama, hf_neox, own_llama], ids=["hf_llama", "hf_neox", "own_llama"])
def test_construction_time_buffers_are_recomputed(build):
    eager, meta = built(build, False), built(build, True)
    assert any(b.is_meta for b in meta.buffers())
    compiled = hgraph.compile(meta, ["tp2"], example_inputs=IDS)
    want = dict(eager.named_buffers())
    got = dict(compiled.traced.buffers())
    assert set(want) >= set(got) and got
    for name, value in dict(meta.named_buffers()).items():
        assert not value.is_meta and torch.equal(value, want[name]), name


def test_meta_and_eager_give_identical_buffers_and_programs_under_a_compute_dtype():
    eager = hgraph.compile(built(hf_llama, False), ["tp2"], example_inputs=IDS,
                           options=hgraph.CompileOptions(compute_dtype=torch.bfloat16))
    meta = hgraph.compile(built(hf_llama, True), ["tp2"], example_inputs=IDS,
                          options=hgraph.CompileOptions(compute_dtype=torch.bfloat16))
    for name, value in eager.traced.buffers().items():
        got = meta.traced.buffers()[name]
        assert got.dtype == value.dtype and torch.equal(got, value), name
    assert programs(meta) == programs(eager)


class _Table(nn.Module):
    """A buffer computed at construction with no scheme that recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.arange(4.0), persistent=False)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.scale)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 4)
        self.table = _Table()
        self.head = nn.Linear(4, 256)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(self.embed(input_ids)))


def test_a_buffer_no_scheme_recomputes_raises_instead_of_garbage():
    with torch.device("meta"):
        model = _Model()
    with pytest.raises(InputError, match=r"buffer 'table\.scale' of module 'table' \(_Table\).*reset_parameters"):
        hgraph.compile(model, ["tp1"], example_inputs=IDS)


def test_meta_model_has_no_master_values():
    compiled = hgraph.compile(built(hf_llama, True), ["tp2"], example_inputs=IDS)
    with pytest.raises(InputError, match="meta device.*weights=PATH"):
        compiled.master_parameters()
