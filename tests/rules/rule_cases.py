"""The rule-verification case table: registered op name -> sample-input generators.

Keys are the names ``hgraph.rules.registered_ops()`` reports (an overload packet such as
``aten.add`` covers all its overloads; each sample names the overload it calls). Adding a case for a
new rule is one entry::

    "aten.diff": [case(aten.diff.default, lambda g: Sample((rand(g, 4, 4, 8), 1, -1)))],

Shapes keep every shardable dim a multiple of 4 (cp token order cuts a dim into 2·cp chunks); data
inputs get every spec of ``rule_harness.input_specs``, parameters (``params=``) are placed by the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from rule_harness import Sample

from hgraph.runtime.kernels.linear_attention import packed_causal_conv1d, packed_gated_delta_rule
from hgraph.runtime.kernels.packed_attention import packed_attention

aten = torch.ops.aten
Make = Callable[[torch.Generator], Sample]


@dataclass(frozen=True)
class Case:
    target: Any
    make: Make
    label: str = ""
    mesh: tuple[int, int] = (2, 2)

    @property
    def name(self) -> str:
        base = str(self.target) if isinstance(self.target, torch._ops.OpOverload) else self.target.__name__
        return base + (f"[{self.label}]" if self.label else "")


def case(target: Any, make: Make, label: str = "", mesh: tuple[int, int] = (2, 2)) -> Case:
    return Case(target, make, label, mesh)


def rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def positive(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5


def ints(g: torch.Generator, *shape: int, high: int = 16) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=g)


def mask(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g) > 0.5


def distinct(g: torch.Generator, *shape: int, high: int) -> torch.Tensor:
    """Indices below ``high``, distinct along the last dim (an overwriting scatter is then deterministic)."""
    return torch.rand(*shape[:-1], high, generator=g).argsort(-1)[..., : shape[-1]]


def complex_rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.complex(rand(g, *shape), rand(g, *shape))


X = (4, 4, 8)  # [batch, tokens, features]


def unary(target: Any, gen: Callable = rand, *extra: Any) -> list[Case]:
    return [case(target, lambda g: Sample((gen(g, *X), *extra)))]


def binary(target: Any, gen: Callable = rand, *extra: Any) -> list[Case]:
    """Same shapes, and a broadcast second operand ``[4, 1, 8]``."""
    return [
        case(target, lambda g: Sample((gen(g, *X), gen(g, *X), *extra))),
        case(target, lambda g: Sample((gen(g, *X), gen(g, 4, 1, 8), *extra)), "broadcast"),
    ]


def _attention_inputs(g: torch.Generator) -> Sample:
    return Sample((rand(g, 1, 4, 8, 4), rand(g, 1, 4, 8, 4), rand(g, 1, 4, 8, 4), _positions()),
                  names=("q", "k", "v", "position_ids"))


def _alibi_attention_inputs(g: torch.Generator) -> Sample:
    """ALiBi slopes (a constant of the model, placed by the rule: cut with the query heads)."""
    sample = _attention_inputs(g)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    return Sample(sample.args, {"alibi": slopes}, names=(*sample.names, "alibi"), params=frozenset({"alibi"}))


_OFFSETS = torch.tensor([2, 4, 4, 8], dtype=torch.int32)  # expert 2 gets no token


def _grouped_mm() -> Any:
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    return torch.ops.transformers.grouped_mm_fallback.default


def _positions() -> torch.Tensor:
    return torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # two packed sequences


def _sink_attention_inputs(g: torch.Generator) -> Sample:
    """gpt-oss's learned sink logit per query head (a parameter, cut with the heads), Llama 4's chunks."""
    return Sample((rand(g, 1, 4, 8, 4), rand(g, 1, 4, 8, 4), rand(g, 1, 4, 8, 4), _positions()),
                  {"sinks": rand(g, 4), "chunk": 3}, names=("q", "k", "v", "position_ids", "p_sinks"),
                  params=frozenset({"p_sinks"}))


def _delta_rule_inputs(g: torch.Generator) -> Sample:
    """Gated DeltaNet: 4 k heads serving 8 v heads, three packed documents per row."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    return Sample((rand(g, 2, 8, 4, 4), rand(g, 2, 8, 4, 4), rand(g, 2, 8, 8, 4), -positive(g, 2, 8, 8),
                   positive(g, 2, 8, 8) / 2, positions), {"chunk_size": 4, "l2norm": True},
                  names=("q", "k", "v", "g", "beta", "position_ids"))


def _conv_inputs(g: torch.Generator) -> Sample:
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    return Sample((rand(g, 2, 8, 8), rand(g, 8, 1, 4), rand(g, 8), positions), names=("x", "p_w", "p_b", "position_ids"),
                  params=frozenset({"p_w", "p_b"}))


CASES: dict[str, list[Case]] = {
    # ---------------------------------------------------------------- elementwise.py: pointwise
    "aten.add": binary(aten.add.Tensor) + unary(aten.add.Scalar, rand, 1.5),
    "aten.sub": binary(aten.sub.Tensor),
    "aten.mul": binary(aten.mul.Tensor) + unary(aten.mul.Scalar, rand, 3.0) + binary(aten.mul.Tensor, complex_rand),
    "aten.div": binary(aten.div.Tensor, positive),
    "aten.pow": unary(aten.pow.Tensor_Scalar, rand, 2) + binary(aten.pow.Tensor_Tensor, positive),
    "aten.rsub": unary(aten.rsub.Scalar, rand, 1.0),
    "aten.maximum": binary(aten.maximum.default),
    "aten.minimum": binary(aten.minimum.default),
    "aten.where": [case(aten.where.self, lambda g: Sample((mask(g, *X), rand(g, *X), rand(g, 4, 1, 8))))],
    "aten.eq": binary(aten.eq.Tensor, ints),
    "aten.ne": binary(aten.ne.Tensor, ints),
    "aten.lt": binary(aten.lt.Tensor),
    "aten.le": binary(aten.le.Tensor),
    "aten.gt": binary(aten.gt.Tensor) + unary(aten.gt.Scalar, rand, 0.0),
    "aten.ge": binary(aten.ge.Tensor),
    "aten.logical_and": binary(aten.logical_and.default, mask),
    "aten.logical_or": binary(aten.logical_or.default, mask),
    "aten.logical_not": unary(aten.logical_not.default, mask),
    "aten.bitwise_and": binary(aten.bitwise_and.Tensor, mask),
    "aten.bitwise_or": binary(aten.bitwise_or.Tensor, mask),
    "aten.bitwise_not": unary(aten.bitwise_not.default, mask),
    "aten.masked_fill": [case(aten.masked_fill.Scalar, lambda g: Sample((rand(g, *X), mask(g, 4, 1, 8), -1.0)))],
    "aten.clamp": unary(aten.clamp.default, rand, -0.5, 0.5),
    "aten.clamp_min": unary(aten.clamp_min.default, rand, 0.1),
    "aten.clamp_max": unary(aten.clamp_max.default, rand, 0.1),
    "aten.remainder": unary(aten.remainder.Scalar, rand, 0.7),
    "aten.floor_divide": binary(aten.floor_divide.default, lambda g, *s: ints(g, *s) + 1),
    "aten.neg": unary(aten.neg.default),
    "aten.rsqrt": unary(aten.rsqrt.default, positive),
    "aten.sqrt": unary(aten.sqrt.default, positive),
    "aten.exp": unary(aten.exp.default),
    "aten.log": unary(aten.log.default, positive),
    "aten.sin": unary(aten.sin.default),
    "aten.cos": unary(aten.cos.default),
    "aten.tanh": unary(aten.tanh.default),
    "aten.sigmoid": unary(aten.sigmoid.default),
    "aten.silu": unary(aten.silu.default),
    "aten.gelu": unary(aten.gelu.default) + [case(aten.gelu.default, lambda g: Sample((rand(g, *X),), {"approximate": "tanh"}), "tanh")],
    "aten.relu": unary(aten.relu.default),
    "aten.abs": unary(aten.abs.default),
    "aten.reciprocal": unary(aten.reciprocal.default, positive),
    "aten.erf": unary(aten.erf.default),
    "aten.square": unary(aten.square.default),
    "aten.log1p": unary(aten.log1p.default, positive),
    "aten.expm1": unary(aten.expm1.default),
    "aten.sign": unary(aten.sign.default),
    "aten.softplus": unary(aten.softplus.default),
    "aten.fill": unary(aten.fill.Scalar, rand, 2.0),
    "aten.floor": unary(aten.floor.default),
    "aten.ceil": unary(aten.ceil.default),
    "aten.addcmul": [case(aten.addcmul.default, lambda g: Sample((rand(g, *X), rand(g, *X), rand(g, 4, 1, 8)), {"value": 0.5}))],
    # ---------------------------------------------------------------- elementwise.py: copies, factories
    "aten.clone": unary(aten.clone.default),
    "aten.contiguous": [case(aten.contiguous.default, lambda g: Sample((rand(g, *X),)))],
    "aten.alias": unary(aten.alias.default),
    "aten.detach": unary(aten.detach.default),
    "aten.lift_fresh_copy": unary(aten.lift_fresh_copy.default),
    "aten._to_copy": [case(aten._to_copy.default, lambda g: Sample((rand(g, *X),), {"dtype": torch.float64}))],
    "aten.to": unary(aten.to.dtype, rand, torch.float64),
    "aten.type_as": binary(aten.type_as.default),
    "aten.dropout": unary(aten.dropout.default, rand, 0.0, True),
    "aten.arange": [case(aten.arange.default, lambda g: Sample((8,), {"dtype": torch.float64}))],
    "aten.zeros": [case(aten.zeros.default, lambda g: Sample(([4, 8],), {"dtype": torch.float64}))],
    "aten.ones": [case(aten.ones.default, lambda g: Sample(([4, 8],), {"dtype": torch.float64}))],
    "aten.full": [case(aten.full.default, lambda g: Sample(([4, 8], 2.0), {"dtype": torch.float64}))],
    "aten.empty": [case(aten.empty.memory_format, lambda g: Sample(([4, 8],), {"dtype": torch.float64}, values=False))],
    "aten.scalar_tensor": [case(aten.scalar_tensor.default, lambda g: Sample((1.5,), {"dtype": torch.float64}))],
    "aten.new_zeros": unary(aten.new_zeros.default, rand, [4, 8]),
    "aten.new_ones": unary(aten.new_ones.default, rand, [4, 8]),
    "aten.new_full": unary(aten.new_full.default, rand, [4, 8], 3.0),
    "aten.new_empty": [case(aten.new_empty.default, lambda g: Sample((rand(g, *X), [4, 8]), values=False))],
    "aten.zeros_like": unary(aten.zeros_like.default),
    "aten.ones_like": unary(aten.ones_like.default),
    "aten.full_like": unary(aten.full_like.default, rand, 2.0),
    "aten.empty_like": [case(aten.empty_like.default, lambda g: Sample((rand(g, *X),), values=False))],
    "aten.sym_size": unary(aten.sym_size.int, rand, 1),
    "aten.sym_numel": unary(aten.sym_numel.default),
    "aten.sym_stride": unary(aten.sym_stride.int, rand, 0),
    "aten._assert_tensor_metadata": [
        case(aten._assert_tensor_metadata.default, lambda g: Sample((rand(g, *X),), {"dtype": torch.float64}))
    ],
    # ---------------------------------------------------------------- shape.py
    "aten.view": unary(aten.view.default, rand, [4, 4, 2, 4]) + unary(aten.view.default, rand, [16, 8]),
    "aten.reshape": unary(aten.reshape.default, rand, [4, 32]) + unary(aten.reshape.default, rand, [4, 4, 4, 2]),
    "aten._unsafe_view": unary(aten._unsafe_view.default, rand, [16, 8]),
    "aten.flatten": unary(aten.flatten.using_ints, rand, 0, 1) + unary(aten.flatten.using_ints, rand, 1, 2),
    "aten.unflatten": unary(aten.unflatten.int, rand, -1, [2, 4]) + unary(aten.unflatten.int, rand, 1, [2, 2]),
    "aten.view_as": [case(aten.view_as.default, lambda g: Sample((rand(g, *X), rand(g, 16, 8))))],
    "aten.expand": [case(aten.expand.default, lambda g: Sample((rand(g, 4, 1, 8), [4, 4, 8])))],
    "aten.transpose": unary(aten.transpose.int, rand, 1, 2),
    "aten.t": [case(aten.t.default, lambda g: Sample((rand(g, 4, 8),)))],
    "aten.permute": unary(aten.permute.default, rand, [2, 0, 1]),
    "aten.unsqueeze": unary(aten.unsqueeze.default, rand, 1),
    "aten.squeeze": [case(aten.squeeze.dim, lambda g: Sample((rand(g, 4, 1, 8), 1)))],
    "aten.slice": unary(aten.slice.Tensor, rand, 2, 0, 4) + unary(aten.slice.Tensor, rand, 1, 0, 9223372036854775807),
    "aten.select": unary(aten.select.int, rand, 1, 2),
    "aten.split": unary(aten.split.Tensor, rand, 4, -1),
    "aten.split_with_sizes": unary(aten.split_with_sizes.default, rand, [4, 4], -1),
    "aten.chunk": unary(aten.chunk.default, rand, 2, -1) + unary(aten.chunk.default, rand, 2, 1),
    "aten.unbind": [case(aten.unbind.int, lambda g: Sample((rand(g, 4, 2, 8), 1)))],
    "_operator.getitem": unary(aten.chunk.default, rand, 2, 0),  # the getitems of a list output
    "aten.cat": [case(aten.cat.default, lambda g: Sample(([rand(g, *X), rand(g, *X)], -1)))],
    "aten.concat": [case(aten.concat.default, lambda g: Sample(([rand(g, *X), rand(g, 4, 4, 4)], -1)))],
    "aten.stack": [case(aten.stack.default, lambda g: Sample(([rand(g, *X), rand(g, *X)], 1)))],
    # ---------------------------------------------------------------- linear.py
    "aten.linear": [
        case(aten.linear.default, lambda g: Sample((rand(g, *X), rand(g, 8, 8)), names=("x", "p_w"), params=frozenset({"p_w"}))),
        case(aten.linear.default, lambda g: Sample((rand(g, *X), rand(g, 4, 8), rand(g, 4)), names=("x", "p_w", "p_b"),
                                                   params=frozenset({"p_w", "p_b"})), "bias"),
        case(aten.linear.default, lambda g: Sample((rand(g, *X), rand(g, 1, 8)), names=("x", "p_w"), params=frozenset({"p_w"})),
             "one output feature"),
    ],
    "aten.addmm": [
        case(aten.addmm.default, lambda g: Sample((rand(g, 8), rand(g, 16, 8), rand(g, 8, 8)), names=("p_b", "x", "p_w"),
                                                  params=frozenset({"p_w", "p_b"}))),
        case(aten.addmm.default, lambda g: Sample((rand(g, 8, 4), rand(g, 8, 8), rand(g, 8, 4))), "activations"),
    ],
    "aten.mm": [
        case(aten.mm.default, lambda g: Sample((rand(g, 16, 8), rand(g, 8, 8)), names=("x", "p_w"), params=frozenset({"p_w"}))),
        case(aten.mm.default, lambda g: Sample((rand(g, 8, 8), rand(g, 8, 4))), "activations"),
    ],
    "aten.bmm": [case(aten.bmm.default, lambda g: Sample((rand(g, 4, 8, 4), rand(g, 4, 4, 8))))],
    "aten.matmul": [case(aten.matmul.default, lambda g: Sample((rand(g, 4, 4, 8, 4), rand(g, 4, 4, 4, 8))))],
    "aten.tril": [
        case(aten.tril.default, lambda g: Sample((rand(g, 4, 8, 8),))),
        case(aten.tril.default, lambda g: Sample((rand(g, 4, 8, 8), -1)), "offset"),
    ],
    "aten.triu": [case(aten.triu.default, lambda g: Sample((rand(g, 4, 8, 8), 1)))],
    "aten.argsort": [
        case(aten.argsort.default, lambda g: Sample((rand(g, 4, 8, 8), 1))),
        case(aten.argsort.stable, lambda g: Sample((rand(g, 4, 8, 8),), {"stable": True, "dim": -1, "descending": True}), "stable"),
    ],
    "aten.bincount": [case(aten.bincount.default, lambda g: Sample((ints(g, 16),)))],
    # ---------------------------------------------------------------- einsum.py
    "aten.einsum": [
        case(aten.einsum.default, lambda g: Sample(("bqhd,bkhd->bhqk", [rand(g, 2, 8, 4, 4), rand(g, 2, 8, 4, 4)])), "scores"),
        case(aten.einsum.default, lambda g: Sample(("bhqk,bkhd->bqhd", [rand(g, 2, 4, 8, 8), rand(g, 2, 8, 4, 4)])), "values"),
        case(aten.einsum.default, lambda g: Sample(("...ij,...jk", [rand(g, 4, 4, 8), rand(g, 4, 8, 4)])), "ellipsis-implicit"),
        case(aten.einsum.default, lambda g: Sample(("btd,hd->bth", [rand(g, 4, 8, 8), rand(g, 8, 8)]), names=("x", "p_w"),
                                                   params=frozenset({"p_w"})), "weight"),
        case(aten.einsum.default, lambda g: Sample(("bij->bi", [rand(g, 4, 8, 4)])), "summed"),
        case(aten.einsum.default, lambda g: Sample(("ii->i", [rand(g, 8, 8)])), "diagonal"),
        case(aten.einsum.default, lambda g: Sample(("i,j->ij", [rand(g, 8), rand(g, 4)])), "outer"),
        case(aten.einsum.default, lambda g: Sample(("ij,jk,kl->il", [rand(g, 4, 8), rand(g, 8, 4), rand(g, 4, 8)])), "chain"),
        case(aten.einsum.default, lambda g: Sample(("bij,bjk->bik", [rand(g, 1, 4, 8), rand(g, 4, 8, 4)])), "broadcast"),
    ],
    # ---------------------------------------------------------------- embedding.py, loss.py
    "aten.embedding": [
        case(aten.embedding.default, lambda g: Sample((rand(g, 16, 8), ints(g, 4, 8)), names=("p_w", "ids"),
                                                      params=frozenset({"p_w"})))
    ],
    "aten.cross_entropy_loss": [
        case(aten.cross_entropy_loss.default, lambda g: Sample((rand(g, 16, 8), ints(g, 16, high=8), None, 2, -100)), "sum"),
        case(aten.cross_entropy_loss.default, lambda g: Sample((rand(g, 16, 8), ints(g, 16, high=8))), "mean"),
    ],
    # ---------------------------------------------------------------- norm.py
    "aten.sum": unary(aten.sum.dim_IntList, rand, [-1]) + unary(aten.sum.dim_IntList, rand, [1], True) + unary(aten.sum.default),
    "aten.mean": unary(aten.mean.dim, rand, [-1], True) + unary(aten.mean.dim, rand, [1]),
    "aten.amax": unary(aten.amax.default, rand, [-1], True),
    "aten.amin": unary(aten.amin.default, rand, [1]),
    "aten.logsumexp": unary(aten.logsumexp.default, rand, [-1], True),
    "aten.prod": unary(aten.prod.dim_int, positive, -1),
    "aten._softmax": unary(aten._softmax.default, rand, -1, False),
    "aten.softmax": unary(aten.softmax.int, rand, 1),
    "aten._log_softmax": unary(aten._log_softmax.default, rand, -1, False),
    "aten.log_softmax": unary(aten.log_softmax.int, rand, -1),
    "aten.layer_norm": [
        case(aten.layer_norm.default, lambda g: Sample((rand(g, *X), [8], rand(g, 8), rand(g, 8), 1e-5),
                                                       names=("x", "p_w", "p_b"), params=frozenset({"p_w", "p_b"})))
    ],
    "aten.rms_norm": [
        case(aten.rms_norm.default, lambda g: Sample((rand(g, *X), [8], rand(g, 8), 1e-6), names=("x", "p_w"),
                                                     params=frozenset({"p_w"})))
    ],
    # ---------------------------------------------------------------- moe.py
    "aten.topk": unary(aten.topk.default, rand, 2, -1) + unary(aten.topk.default, rand, 2, 1),
    "aten.sort": unary(aten.sort.default, rand, -1),
    "aten.cumsum": unary(aten.cumsum.default, rand, 1),
    "aten.histc": unary(aten.histc.default, rand, 4, -2.0, 2.0),
    # routing by ``torch.where(expert_mask)`` (litgpt's LLaMAMoE): the positions of every True element
    "aten.nonzero": [case(aten.nonzero.default, lambda g: Sample((mask(g, 8, 4),)))],
    "aten.where.default": [case(aten.where.default, lambda g: Sample((mask(g, 8, 4),)))],
    "aten.cumprod": unary(aten.cumprod.default, positive, 1),
    # ---------------------------------------------------------------- norm.py: max / min / arg reductions
    "aten.max": unary(aten.max.dim, rand, -1) + unary(aten.max.dim, rand, 1, True) + binary(aten.max.other)
    + unary(aten.max.default),
    "aten.min": unary(aten.min.dim, rand, 2) + binary(aten.min.other) + unary(aten.min.default),
    "aten.argmax": unary(aten.argmax.default, rand, -1) + unary(aten.argmax.default, rand, 1, True),
    "aten.argmin": unary(aten.argmin.default, rand, 0),
    # ---------------------------------------------------------------- scatter_gather.py (routers, experts, fresh buffers)
    "aten.gather": [
        case(aten.gather.default, lambda g: Sample((rand(g, *X), -1, ints(g, 4, 4, 4, high=8)))),
        case(aten.gather.default, lambda g: Sample((rand(g, 4, 8, 4), 1, ints(g, 4, 4, 4, high=8))), "tokens"),
    ],
    "aten.scatter": [
        case(aten.scatter.value, lambda g: Sample((rand(g, *X), -1, ints(g, 4, 4, 4, high=8), 1.0))),
        case(aten.scatter.src, lambda g: Sample((rand(g, *X), -1, distinct(g, 4, 4, 4, high=8), rand(g, 4, 4, 4))),
             "src"),
        case(aten.scatter.src, lambda g: Sample((rand(g, 4, 8, 4), 1, distinct(g, 4, 4, 4, high=8).transpose(1, 2),
                                                 rand(g, 4, 4, 4))), "src along tokens"),
    ],
    "aten.scatter_add": [
        case(aten.scatter_add.default, lambda g: Sample((rand(g, *X), -1, ints(g, 4, 4, 4, high=8), rand(g, 4, 4, 4)))),
    ],
    "aten.index_add": [
        case(aten.index_add.default, lambda g: Sample((rand(g, 8, 8), 0, ints(g, 4, high=8), rand(g, 4, 8)), {"alpha": 0.5})),
        case(aten.index_add.default, lambda g: Sample((rand(g, 4, 8, 4), 1, ints(g, 4, high=8), rand(g, 4, 4, 4))),
             "inner dim"),
    ],
    "aten.slice_scatter": [
        case(aten.slice_scatter.default, lambda g: Sample((rand(g, *X), rand(g, 4, 4, 4), -1, 4, 8))),
        case(aten.slice_scatter.default, lambda g: Sample((rand(g, *X), rand(g, 4, 4, 4), 2, 0, 8, 2)), "strided"),
    ],
    "aten.select_scatter": [
        case(aten.select_scatter.default, lambda g: Sample((rand(g, *X), rand(g, 4, 8), 1, 2))),
    ],
    # ---------------------------------------------------------------- complex.py (complex rotary embeddings)
    "aten.polar": [case(aten.polar.default, lambda g: Sample((positive(g, *X), rand(g, *X))))],
    "aten.view_as_complex": [case(aten.view_as_complex.default, lambda g: Sample((rand(g, 4, 4, 8, 2),)))],
    "aten.view_as_real": [case(aten.view_as_real.default, lambda g: Sample((complex_rand(g, *X),)))],
    # ---------------------------------------------------------------- conv.py
    "aten.conv1d": [
        case(aten.conv1d.default, lambda g: Sample((rand(g, 4, 8, 8), rand(g, 8, 1, 4), rand(g, 8), [1], [3], [1], 8),
                                                   names=("x", "p_w", "p_b"), params=frozenset({"p_w", "p_b"})),
             "depthwise causal"),
        case(aten.conv1d.default, lambda g: Sample((rand(g, 4, 8, 8), rand(g, 8, 2, 3), None, [1], [1], [1], 4),
                                                   names=("x", "p_w"), params=frozenset({"p_w"})), "grouped"),
        case(aten.conv1d.default, lambda g: Sample((rand(g, 4, 8, 8), rand(g, 4, 8, 3)), names=("x", "p_w"),
                                                   params=frozenset({"p_w"})), "dense"),
    ],
    "aten.index.Tensor": [
        case(aten.index.Tensor, lambda g: Sample((rand(g, 8, 4, 8), [ints(g, 4, 4, high=8)]))),
        case(aten.index.Tensor, lambda g: Sample((rand(g, 8, 8, 4), [ints(g, 4, high=8), ints(g, 4, high=8)])), "two indices"),
        case(aten.index.Tensor, lambda g: Sample((rand(g, 4, 8, 4), [None, ints(g, 4, 4, high=8)])), "inner dim"),
    ],
    "aten.diff": [case(aten.diff.default, lambda g: Sample((rand(g, *X), 1, 1)))],
    "aten.repeat": [
        case(aten.repeat.default, lambda g: Sample((rand(g, *X), [1, 2, 1]))),
        case(aten.repeat.default, lambda g: Sample((rand(g, *X), [2, 1, 1, 1])), "new leading dim"),
    ],
    "aten.repeat_interleave.self_int": [case(aten.repeat_interleave.self_int, lambda g: Sample((rand(g, *X), 2, 2)))],
    "aten.numpy_T": unary(aten.numpy_T.default),
    "aten.baddbmm": [
        case(aten.baddbmm.default, lambda g: Sample((rand(g, 4, 8, 8), rand(g, 4, 8, 4), rand(g, 4, 4, 8)), {"alpha": 0.5}))
    ],
    "aten.__and__": binary(aten.__and__.Tensor, mask),
    "aten.__or__": binary(aten.__or__.Tensor, mask),
    "aten.index_put": [
        case(aten.index_put.default, lambda g: Sample((rand(g, 8, 4), [torch.randperm(8, generator=g)[:4]], rand(g, 4, 4))))
    ],
    "aten.index_put_": [
        case(aten.index_put_.default, lambda g: Sample((rand(g, 8, 4), [torch.randperm(8, generator=g)[:4]], rand(g, 4, 4)),
                                                       inplace=True))
    ],
    "aten.div_": [case(aten.div_.Tensor, lambda g: Sample((rand(g, *X), positive(g, 4, 4, 1)), inplace=True))],
    "aten.mul_": [case(aten.mul_.Tensor, lambda g: Sample((rand(g, *X), rand(g, *X)), inplace=True))],
    "aten.add_": [case(aten.add_.Tensor, lambda g: Sample((rand(g, *X), rand(g, 4, 1, 8)), inplace=True))],
    "aten.sub_": [case(aten.sub_.Tensor, lambda g: Sample((rand(g, *X), rand(g, *X)), inplace=True))],
    "transformers.grouped_mm_fallback": [
        case(_grouped_mm(), lambda g: Sample((rand(g, 8, 8), rand(g, 4, 8, 8), _OFFSETS), names=("x", "p_w", "offs"),
                                             params=frozenset({"p_w"})), "parameter"),
        case(_grouped_mm(), lambda g: Sample((rand(g, 8, 8), rand(g, 4, 8, 4), _OFFSETS)), "activations"),
    ],
    # ---------------------------------------------------------------- attention.py
    "hgraph.runtime.kernels.packed_attention.packed_attention": [
        case(packed_attention, _attention_inputs),
        case(packed_attention, _sink_attention_inputs, "sinks, chunks"),
        case(packed_attention, _alibi_attention_inputs, "alibi"),
    ],
    # ---------------------------------------------------------------- linear_attention.py
    "hgraph.runtime.kernels.linear_attention.packed_gated_delta_rule": [case(packed_gated_delta_rule, _delta_rule_inputs)],
    "hgraph.runtime.kernels.linear_attention.packed_causal_conv1d": [case(packed_causal_conv1d, _conv_inputs)],
    "aten.scaled_dot_product_attention": [
        case(aten.scaled_dot_product_attention.default,
             lambda g: Sample((rand(g, 1, 4, 8, 4), rand(g, 1, 4, 8, 4), rand(g, 1, 4, 8, 4)), {"is_causal": True}),
             "tp only", mesh=(1, 2))
    ],
}
