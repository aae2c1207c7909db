"""An analytic cost model: Transformer FLOP counts plus alpha-beta communication, no profiling.

For a Llama-style decoder layer (hidden ``H``, FFN ``F``, ``kv`` key/value width ``H_kv``), per token
and per forward pass::

    linear     = 2 * (2*H*H + 2*H*H_kv + 3*H*F)     QKV, output projection, SwiGLU MLP
    attention  = 2 * H * l                          causal QK^T and AV of a sequence of l tokens
    lm_head    = 2 * H * V                          last stage only

Forward plus backward is three forward passes. A stage of ``ceil(L/pp)`` layers (the last stage also
holds the LM head: the slowest stage sets the pipeline's pace) split over ``tp`` ranks and ``cp``
ranks runs at ``peak_flops * mfu``, so over a micro-batch of sequences ``l_i``::

    T = a * sum(l_i^2) + b * sum(l_i) + c

    a = 3 * 2*H * Ls / (tp*cp) / speed
    b = 3 * (Ls*linear + lm_head) / (tp*cp) / speed  +  communication bytes per token / bandwidth
    c = Ls * layer_overhead  +  communication latencies

Communication (alpha-beta, ring algorithms; intra-node bandwidth when the group fits in a node):

* TP: 4 all-reduces per layer (2 forward, 2 backward) of ``2*l/cp*H`` bytes (bf16):
  ``2(tp-1)/tp * bytes / bw + 2(tp-1) * latency`` each.
* CP (ring attention): per layer and pass, ``cp-1`` exchanges of the local K and V chunk
  (``2 * 2*l/cp*H_kv/tp`` bytes); the backward pass moves K, V and their gradients (twice the
  forward volume). Counted as not overlapped with attention: an upper bound.
* PP: one activation send forward and one gradient send backward of ``2*l/cp*H/tp`` bytes per stage.

Mixture of experts (``experts > 0``): the FFN is ``top_k`` routed experts of width ``expert_ffn`` plus
a router. With the experts tp-sharded (``ep = 1``) they cost as a dense FFN of that width. Under expert
parallelism (``ep > 1``) their FLOPs are the busiest group's (``imbalance`` times the even share),
the two MLP all-reduces of each layer are replaced by four all-to-alls and the tp gather of the
tokens (``hgraph.planner.experts``).

Every term is linear in ``l`` except attention, so the model is exactly of the table form and is
returned as a ``CostModel`` (with the analytic MaxLen constants) that can be saved as a table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from hgraph.errors import CostModelError
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel, StageCost
from hgraph.planner.experts import (
    EVEN_ROUTING,
    MoELayerShape,
    all_to_all_bytes_per_token,
    token_gather_bytes_per_token,
)
from hgraph.planner.memory import MemoryRegression

BF16 = 2
REPLICATED_BYTES = 1.5  # gathered sequence-parallel buffers per H and extra TP rank (A800 fit)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder: the numbers the FLOP and memory counts need."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    top_k: int = 0
    expert_ffn: int | None = None  # each expert's width (default: ffn)

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "ffn", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"ModelConfig {name}={value!r}; it must be an integer >= 1")
        if self.hidden % self.heads:
            raise CostModelError(f"ModelConfig hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise CostModelError(
                f"ModelConfig kv_heads={self.kv_heads!r}; it must be >= 1 and divide heads={self.heads}"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise CostModelError(f"ModelConfig top_k={self.top_k!r}; an MoE model routes 1..{self.experts} experts per token")

    def moe(self, layers: int) -> MoELayerShape | None:
        """The MoE shape of ``layers`` layers (None for a dense model)."""
        if not self.experts:
            return None
        return MoELayerShape(self.hidden, self.experts, self.top_k, self.expert_ffn or self.ffn, layers)

    @property
    def kv_hidden(self) -> int:
        """Width of the K (and V) projection: ``H * kv_heads / heads``."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, SwiGLU MLP or routed experts and router, two norms)."""
        h, f = self.hidden, self.ffn
        if self.experts:
            return 2 * h * h + 2 * h * self.kv_hidden + self.experts * 3 * h * (self.expert_ffn or f) + h * self.experts + 2 * h
        return 2 * h * h + 2 * h * self.kv_hidden + 3 * h * f + 2 * h

    def params(self) -> int:
        """All parameters: layers, untied embedding and LM head, final norm."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden + self.hidden

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of one layer's matmuls per token (an MoE layer: router and ``top_k`` experts)."""
        h = self.hidden
        moe = self.moe(1)
        if moe is not None:
            return 2.0 * (2 * h * h + 2 * h * self.kv_hidden + h * self.experts) + moe.expert_flops_per_token()
        return 2.0 * (2 * h * h + 2 * h * self.kv_hidden + 3 * h * self.ffn)

    def activation_bytes(self, tp: int) -> float:
        """``A_tp``: activation bytes per token per ``H/tp`` per layer (sequence parallel, flash attention).

        Saved for backward, bf16: two norm inputs and two norm outputs (8H), Q, K, V and the attention
        output (4H + 4H_kv), SwiGLU gate/up outputs and their product (6F); all sharded by TP with
        sequence parallelism, plus ``REPLICATED_BYTES * (tp - 1)`` of gathered buffers per H (fitted
        to the A800 tables: 38, 39, 42, 48, 61 for tp 1..16).
        """
        h = self.hidden
        saved = 8 * h + 4 * h + 4 * self.kv_hidden + 6 * self.ffn
        return saved / h + REPLICATED_BYTES * (tp - 1)


@dataclass(frozen=True)
class HardwareSpec:
    """One kind of GPU and its interconnect; bandwidths in bytes/s per GPU, latencies in seconds."""

    name: str
    peak_flops: float
    memory_bytes: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int = 8
    intra_latency: float = 10e-6
    inter_latency: float = 25e-6
    mfu: float = 0.5
    layer_overhead: float = 1e-3  # kernel launches, norms, copies: per layer, forward + backward
    context_bytes: float = 5 * 2**30  # CUDA/NCCL context
    safe_bytes: float = 6 * 2**30  # margin for fragmentation
    sharded_fraction: float = 0.75  # fp32 master + Adam share of the 16 B/param

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                raise CostModelError(f"HardwareSpec {name}={getattr(self, name)!r}; it must be > 0")
        if not 0 < self.mfu <= 1:
            raise CostModelError(f"HardwareSpec mfu={self.mfu!r}; it is a fraction in (0, 1]")
        if self.gpus_per_node < 1:
            raise CostModelError(f"HardwareSpec gpus_per_node={self.gpus_per_node!r}; it must be >= 1")

    @classmethod
    def preset(cls, name: str) -> HardwareSpec:
        """``a100-80gb`` or ``h100-80gb`` (dense bf16 peak, NVLink per direction, one IB NIC per GPU)."""
        try:
            return HARDWARE_PRESETS[name]
        except KeyError:
            raise CostModelError(
                f"unknown hardware preset {name!r}; known: {', '.join(HARDWARE_PRESETS)}"
            ) from None

    def bandwidth(self, group_gpus: int) -> tuple[float, float]:
        """(bytes/s, latency s) of a group of ``group_gpus`` consecutive ranks."""
        if group_gpus <= self.gpus_per_node:
            return self.intra_bw, self.intra_latency
        return self.inter_bw, self.inter_latency


HARDWARE_PRESETS = {
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 80 * 2**30, 300e9, 25e9, mfu=0.6),
    "h100-80gb": HardwareSpec("h100-80gb", 989e12, 80 * 2**30, 450e9, 50e9, mfu=0.5),
}


def default_schemes(
    config: ModelConfig, hardware: HardwareSpec, max_gpus: int = 64, cp_degrees: Iterable[int] = (1,)
) -> list[Degrees]:
    """tp in powers of two up to a node (dividing heads and kv heads), pp in 1, 2, 4, 8 (<= layers);
    for an MoE model also every ep > 1 dividing both ``tp·cp`` and the experts."""
    kv = config.kv_heads or config.heads
    tps = [
        t
        for t in (1, 2, 4, 8, 16, 32)
        if t <= hardware.gpus_per_node and config.heads % t == 0 and kv % t == 0
    ]
    pps = [p for p in (1, 2, 4, 8) if p <= config.layers]
    out = []
    for cp in cp_degrees:
        for tp in tps:
            eps = [e for e in range(1, tp * cp + 1) if (tp * cp) % e == 0 and (e == 1 or (config.experts and config.experts % e == 0))]
            out += [Degrees(tp, pp, cp, ep=ep) for pp in pps for ep in eps if tp * pp * cp <= max_gpus]
    return out


def stage_cost(
    config: ModelConfig, hardware: HardwareSpec, scheme: Degrees, imbalance: float = EVEN_ROUTING
) -> StageCost:
    """``T(l) = a*l^2 + b*l + c`` in ms of the slowest stage of ``scheme`` (see the module docstring);
    ``imbalance``: the expert load imbalance an ep scheme is costed with (``hgraph.planner.experts``)."""
    tp, pp, cp, ep = scheme.tp, scheme.pp, scheme.cp, scheme.ep
    if pp > config.layers:
        raise CostModelError(f"scheme {scheme} has more stages than the model's {config.layers} layers")
    h = config.hidden
    stage_layers = math.ceil(config.layers / pp)
    moe = config.moe(stage_layers)
    if ep > 1 and moe is None:
        raise CostModelError(f"scheme {scheme} splits experts but the model config has none (experts=0)")
    speed = hardware.peak_flops * hardware.mfu
    a = 3 * 2 * h * stage_layers / (tp * cp) / speed
    linear = config.linear_flops_per_token()
    if moe is not None and ep > 1:  # the stage waits for its busiest expert group
        linear += (imbalance - 1) * moe.expert_flops_per_token()
    b = 3 * (stage_layers * linear + 2 * h * config.vocab) / (tp * cp) / speed
    c = stage_layers * hardware.layer_overhead
    if tp > 1:
        bw, lat = hardware.bandwidth(tp)
        per_token = BF16 * h / cp
        reduces = 2 if moe is not None and ep > 1 else 4  # ep: the MLP's two all-reduces are gone
        b += stage_layers * reduces * 2 * (tp - 1) / tp * per_token / bw
        c += stage_layers * reduces * 2 * (tp - 1) * lat
    if moe is not None and ep > 1:
        bw, lat = hardware.bandwidth(tp * cp)
        moved = all_to_all_bytes_per_token(moe, cp, tp, ep, BF16) + token_gather_bytes_per_token(moe, cp, tp, ep, BF16)
        b += moved / bw
        c += stage_layers * (4 * (ep - 1) + (2 * (tp - 1) if tp > 1 else 0)) * lat
    if cp > 1:
        bw, lat = hardware.bandwidth(tp * cp)
        per_token = 2 * BF16 * config.kv_hidden / tp / cp  # K and V of one token
        b += stage_layers * 3 * (cp - 1) * per_token / bw
        c += stage_layers * 3 * (cp - 1) * lat
    if pp > 1:
        bw, lat = hardware.bandwidth(tp * cp * pp)
        b += 2 * BF16 * h / tp / cp / bw
        c += 2 * lat
    return StageCost(a * 1e3, b * 1e3, c * 1e3)


def memory_regression(config: ModelConfig, hardware: HardwareSpec, tps: Iterable[int]) -> MemoryRegression:
    """MaxLen constants (DESIGN.md A5) from the model shape and the device memory."""
    return MemoryRegression(
        activation=tuple((tp, config.activation_bytes(tp)) for tp in sorted(set(tps))),
        bytes_per_layer_h2=16.0 * config.layer_params() / config.hidden**2,
        alpha=hardware.sharded_fraction,
        gap=(("node", float(hardware.context_bytes)),),
        safe_bound=float(hardware.safe_bytes),
        gpu_memory=float(hardware.memory_bytes),
        hidden=config.hidden,
        layers=config.layers,
        vocab=config.vocab,
    )


def analytic_cost_model(
    config: ModelConfig,
    hardware: HardwareSpec | str,
    schemes: Iterable[Degrees] | None = None,
    name: str | None = None,
    expert_imbalance: float = EVEN_ROUTING,
) -> CostModel:
    """A ``CostModel`` for ``config`` on ``hardware`` (a spec or a preset name) over ``schemes``;
    ``expert_imbalance``: the busiest expert group's load over the mean that ep schemes are costed
    with (a stated assumption, or ``hgraph.planner.experts.layer_imbalance`` of observed counts)."""
    spec = HardwareSpec.preset(hardware) if isinstance(hardware, str) else hardware
    chosen = list(schemes) if schemes is not None else default_schemes(config, spec)
    if not chosen:
        raise CostModelError("analytic_cost_model needs at least one scheme")
    costs = {s: stage_cost(config, spec, s, expert_imbalance) for s in chosen}
    memory = memory_regression(config, spec, (s.tp for s in chosen))
    about = (
        f"Analytic T(l): FLOP counts at {spec.mfu:.0%} of {spec.peak_flops:.3g} FLOP/s plus alpha-beta "
        f"communication, {spec.name}; model H={config.hidden} L={config.layers} F={config.ffn} "
        f"V={config.vocab}."
        + (f" MoE: {config.experts} experts, top-{config.top_k}, width {config.expert_ffn or config.ffn}; ep schemes "
           f"costed at expert load imbalance {expert_imbalance:g}." if config.experts else "")
    )
    return CostModel(
        name or f"analytic-{spec.name}",
        costs,
        memory,
        gpus_per_node=spec.gpus_per_node,
        extra={"_about": about},
    )
