"""Mixed-precision pass: a reduced ``compute_dtype`` computes what ``torch.autocast`` computes.

The model is traced in fp32 (the user's model, untouched), parameters are pulled in the compute dtype
(bf16: half the Pull bytes), and this pass writes autocast's casts into the program as graph nodes,
with autocast's CUDA op lists:

* matmul-like ops (``linear``, ``matmul``, ``bmm``, …, attention) take their floating inputs in the
  compute dtype and return it;
* fp32 ops (norms, softmax, ``pow``/``rsqrt``/``exp``/``log``, sums, every loss) take fp32 inputs;
* promoting ops (``index_put``, ``scatter_add``, …) take their inputs in the widest dtype among them;
* everything else runs in the dtype its inputs have, by type promotion.

So buffers (rotary tables, masks) stay fp32, and what is computed from them; a matmul's bf16 output
meets the fp32 residual stream and becomes fp32 again, as under autocast. A parameter read by anything
but a matmul-like op (norm weights, embeddings, biases added by hand) is upcast to fp32 where it is
read, so it acts as autocast's fp32 parameter (its value rounded to the pulled bf16). The loss output
is fp32. Every node's ``meta["val"]`` gets the dtype it has at run time.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from hgraph.program.context import CompileContext
from hgraph.runtime.kernels.packed_attention import packed_attention
from hgraph.runtime.kernels.vocab_parallel import vocab_parallel_cross_entropy

aten = torch.ops.aten

# torch.amp's CUDA lists (``lower_precision_fp``, ``fp32``, ``promote``), as overload packets.
LOWER_PRECISION = frozenset({
    aten.linear, aten.matmul, aten.mm, aten.bmm, aten.baddbmm, aten.addmm, aten.addbmm, aten.addmv,
    aten.addr, aten.mv, aten.einsum, aten.chain_matmul, aten.linalg_multi_dot, aten.prelu,
    aten.conv1d, aten.conv2d, aten.conv3d, aten.conv_transpose1d, aten.conv_transpose2d,
    aten.conv_transpose3d, aten.convolution, aten._convolution, aten.scaled_dot_product_attention,
})
LOWER_PRECISION_CALLS = frozenset({packed_attention})
LOWER_PRECISION_NAMES = frozenset({"transformers::grouped_mm_fallback"})  # HF's expert matmul
FP32 = frozenset({
    aten.pow, aten.acos, aten.asin, aten.cosh, aten.sinh, aten.tan, aten.exp, aten.expm1, aten.log,
    aten.log10, aten.log1p, aten.log2, aten.reciprocal, aten.rsqrt, aten.erfinv, aten.softplus,
    aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.layer_norm,
    aten.native_layer_norm, aten.group_norm, aten.rms_norm, aten.norm, aten.renorm, aten.sum,
    aten.prod, aten.cumsum, aten.cumprod, aten.dist, aten.cdist, aten.pdist, aten.cosine_similarity,
    aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.mse_loss, aten.l1_loss,
    aten.smooth_l1_loss, aten.huber_loss, aten.kl_div, aten.binary_cross_entropy_with_logits,
    aten.poisson_nll_loss, aten.margin_ranking_loss, aten.hinge_embedding_loss, aten.soft_margin_loss,
    aten.multi_margin_loss, aten.multilabel_margin_loss, aten.cosine_embedding_loss,
    aten.triplet_margin_loss,
})
FP32_CALLS = frozenset({vocab_parallel_cross_entropy})
PROMOTE = frozenset({
    aten.addcdiv, aten.addcmul, aten.atan2, aten.bilinear, aten.cross, aten.dot, aten.grid_sampler,
    aten.index_put, aten.scatter_add, aten.tensordot,
})
_CASTS = frozenset({aten.to, aten._to_copy})


def policy(node: fx.Node) -> Optional[str]:
    """``"lower"``, ``"fp32"``, ``"promote"`` or None (type promotion) for a call node."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "_qualified_op_name", None)
    if packet in LOWER_PRECISION or target in LOWER_PRECISION_CALLS or name in LOWER_PRECISION_NAMES:
        return "lower"
    if packet in FP32 or target in FP32_CALLS:
        return "fp32"
    if packet in PROMOTE:
        return "promote"
    return None


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _promote(values: list[torch.Tensor], dtypes: list[torch.dtype]) -> Optional[torch.dtype]:
    """torch's promotion among floating tensors: tensors with dimensions outrank 0-dim ones."""
    ranked = [d for v, d in zip(values, dtypes) if v.dim() > 0] or dtypes
    if not ranked:
        return None
    out = ranked[0]
    for d in ranked[1:]:
        out = torch.promote_types(out, d)
    return out


class _Autocast:
    """One walk over the graph: the run-time dtype of every floating value, casts where autocast has them."""

    def __init__(self, gm: fx.GraphModule, compute: torch.dtype, params: set[str]) -> None:
        self.gm, self.compute, self.params = gm, compute, params
        self.dtype: dict[fx.Node, Any] = {}  # node -> dtype, or a list of them for multi-output nodes
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                self._output(node)

    def _placeholder(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if node.name in self.params and _floating(val):
            self.dtype[node] = self.compute  # pulled in the compute dtype
            self._set_val(node, self.compute)
            readers = [u for u in node.users if policy(u) != "lower"]
            if readers:  # autocast reads an fp32 parameter there
                upcast = self._cast(node, torch.float32, before=min(readers, key=self.order.__getitem__))
                for user in readers:
                    user.replace_input_with(node, upcast)
        else:
            self.dtype[node] = val.dtype if isinstance(val, torch.Tensor) else None

    def _call(self, node: fx.Node) -> None:
        kind = policy(node)
        inputs = [a for a in node.all_input_nodes if _floating(a.meta.get("val"))]
        if kind == "lower":
            self._cast_inputs(node, inputs, self.compute)
        elif kind == "fp32":
            self._cast_inputs(node, inputs, torch.float32)
        elif kind == "promote":
            widest = _promote([a.meta["val"] for a in inputs], [self._of(a) for a in inputs])
            if widest is not None:
                self._cast_inputs(node, inputs, widest)
        self.dtype[node] = self._result(node, kind)
        self._set_val(node, self.dtype[node])

    def _result(self, node: fx.Node, kind: Optional[str]) -> Any:
        """The run-time dtype of ``node`` (a list for multi-output nodes)."""
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            inner = self._single(node, kind, None)
            return [inner if _floating(v) and inner is not None else (v.dtype if isinstance(v, torch.Tensor) else None)
                    for v in val]
        if not _floating(val):
            return val.dtype if isinstance(val, torch.Tensor) else None
        return self._single(node, kind, val.dtype)

    def _single(self, node: fx.Node, kind: Optional[str], traced: Optional[torch.dtype]) -> Optional[torch.dtype]:
        explicit = node.kwargs.get("dtype")
        if getattr(node.target, "overloadpacket", None) in _CASTS:
            explicit = explicit or next((a for a in node.args[1:] if isinstance(a, torch.dtype)), None)
        if isinstance(explicit, torch.dtype):
            return explicit
        if node.target is operator.getitem:
            parent, index = node.args
            out = self.dtype.get(parent)
            return out[index] if isinstance(out, list) else out
        if kind == "lower":
            return self.compute
        if kind == "fp32":
            return torch.float32
        if getattr(node.target, "overloadpacket", None) is aten.type_as:
            return self._of(node.args[1])
        name = getattr(node.target, "__name__", "")
        inputs = [a for a in node.all_input_nodes if _floating(a.meta.get("val"))]
        if name.endswith("_") and not name.startswith("_") and inputs:  # in place: self's dtype
            return self._of(node.args[0]) if isinstance(node.args[0], fx.Node) else traced
        promoted = _promote([a.meta["val"] for a in inputs], [self._of(a) for a in inputs])
        return promoted if promoted is not None else traced

    def _output(self, node: fx.Node) -> None:
        outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
        loss = outs[0] if outs else None
        if isinstance(loss, fx.Node) and self._of(loss) not in (None, torch.float32):
            cast = self._cast(loss, torch.float32, before=node)
            node.args = ((cast, *outs[1:]),) if isinstance(node.args[0], (tuple, list)) else (cast,)

    # ------------------------------------------------------------------ helpers
    def _of(self, node: fx.Node) -> Optional[torch.dtype]:
        out = self.dtype.get(node)
        return None if isinstance(out, list) else out

    def _cast_inputs(self, node: fx.Node, inputs: list[fx.Node], dtype: torch.dtype) -> None:
        for value in dict.fromkeys(inputs):
            if self._of(value) != dtype:
                node.replace_input_with(value, self._cast(value, dtype, before=node))

    def _cast(self, value: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        """One ``aten.to.dtype`` node per (value, dtype), shared by every reader."""
        key = (value, dtype)
        cast = self.casts.get(key)
        if cast is None:
            with self.gm.graph.inserting_before(before):
                cast = self.gm.graph.call_function(aten.to.dtype, (value, dtype))
            cast.meta = {k: v for k, v in value.meta.items() if k != "val"}
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                cast.meta["val"] = val.to(dtype)
            self.casts[key] = cast
            self.dtype[cast] = dtype
        return cast

    def _set_val(self, node: fx.Node, dtype: Any) -> None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(dtype, torch.dtype) and val.dtype != dtype:
            node.meta["val"] = val.to(dtype)
        elif isinstance(val, (list, tuple)) and isinstance(dtype, list):
            node.meta["val"] = type(val)(
                v.to(d) if isinstance(v, torch.Tensor) and isinstance(d, torch.dtype) and v.dtype != d else v
                for v, d in zip(val, dtype)
            )


def autocast(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Autocast's casts as graph nodes when ``compute_dtype`` is reduced (module docstring)."""
    dtype = ctx.options.compute_dtype
    if dtype is None or dtype == torch.float32:
        return gm
    _Autocast(gm, dtype, set(ctx.traced.param_names)).run()
    gm.graph.lint()
    gm.recompile()
    return gm
