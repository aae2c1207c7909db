"""Profiling in this one process: whole-model and first-block forward+backward times, fit ``tp1,ppN``.

Measurement (one process, scheme tp1): for each length ``l`` one sequence of ``l`` tokens runs forward
and backward (cross-entropy on random targets) ``--repeats`` times after a warm-up; the median is
``T_tp1,pp1(l)``. For ``pp > 1`` the first decoder block is timed alone on the activations it sees in
the full model, and the stage time is approximated as ``ceil(L/pp) * T_block(l) + T_rest(l)`` where
``T_rest = T_model - L * T_block`` is the embedding, final norm, LM head and loss (on the slowest,
last stage); inter-stage sends are not included.

Memory: MaxLen constants come from the model itself: ``B`` from the parameters of one block,
``A_tp1`` from the bytes the block saves for backward (counted with ``saved_tensors_hooks``),
``gpu_memory_bound`` from ``--memory-gb`` or the device (CUDA total memory, or physical RAM on CPU).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from hgraph.core.degrees import Degrees
from hgraph.core.model_info import decoder_blocks, embedding_of
from hgraph.core.progress import progress
from hgraph.errors import CostModelError
from hgraph.models import load_factory
from hgraph.planner.cost import CostModel
from hgraph.planner.fit import Fit, fit_stage_cost
from hgraph.planner.memory import MemoryRegression
from hgraph.runtime.clock import DeviceClock


class _Profiler:
    """Times one model's forward+backward and its first block's, and counts the block's saved bytes."""

    def __init__(self, model: Any, device: str, dtype: Any, repeats: int) -> None:
        import torch

        self.torch = torch
        self.model = model.to(device=device, dtype=dtype)
        self.device, self.repeats = device, repeats
        self.clock = DeviceClock(device)
        self.blocks = decoder_blocks(self.model)
        embedding = embedding_of(self.model)
        self.vocab, self.hidden = embedding.num_embeddings, embedding.embedding_dim
        self._captured: tuple[tuple, dict] | None = None

    def _median_ms(self, step: Callable[[], None]) -> float:
        """Median over ``repeats`` of the device's time for ``step`` (``hgraph.runtime.clock``)."""
        step()  # warm-up
        times = []
        for _ in range(self.repeats):
            start = self.clock.mark()
            step()
            times.append(self.clock.elapsed_ms(start, self.clock.mark()))
        return statistics.median(times)

    def model_ms(self, length: int) -> float:
        """Median forward+backward time of the whole model on one sequence; captures block inputs."""
        torch = self.torch
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, self.vocab, (1, length), generator=gen).to(self.device)
        targets = torch.randint(0, self.vocab, (1, length), generator=gen).to(self.device)

        def capture(_module: Any, args: tuple, kwargs: dict) -> None:
            self._captured = (
                tuple(a.detach() if torch.is_tensor(a) else a for a in args),
                {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()},
            )

        handle = self.blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:

            def step() -> None:
                self.model.zero_grad(set_to_none=True)
                out = self.model(ids)
                logits = out.logits if hasattr(out, "logits") else out
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
                loss.backward()

            return self._median_ms(step)
        finally:
            handle.remove()

    def _block_step(self) -> tuple[Callable[[], Any], Any]:
        torch = self.torch
        assert self._captured is not None, "run model_ms first"
        args, kwargs = self._captured
        hidden = args[0].clone().requires_grad_(True)
        block = self.blocks[0]

        def forward() -> Any:
            out = block(hidden, *args[1:], **kwargs)
            return out[0] if isinstance(out, tuple) else out

        def step() -> None:
            block.zero_grad(set_to_none=True)
            out = forward()
            out.backward(torch.ones_like(out))

        return step, forward

    def block_ms(self) -> float:
        """Median forward+backward time of the first block on the captured input."""
        step, _ = self._block_step()
        return self._median_ms(step)

    def block_saved_bytes(self) -> int:
        """Bytes of distinct tensors the first block saves for backward (activation memory)."""
        torch = self.torch
        _, forward = self._block_step()
        params = {p.data_ptr() for p in self.blocks[0].parameters()}
        seen: dict[int, int] = {}

        def pack(t: Any) -> Any:
            if t.data_ptr() not in params:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        return sum(seen.values())


def measure(
    model_spec: str, lengths: Sequence[int], device: str, dtype_name: str, repeats: int
) -> dict[str, Any]:
    """Raw measurements: per length the model and block times, plus the model's memory facts."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    model = load_factory(model_spec)()
    profiler = _Profiler(model, device, dtype, repeats)
    profiler.model_ms(min(lengths))  # warm up allocator and kernels before anything is kept
    model_ms, block_ms = [], []
    saved = 0
    for length in progress(lengths, desc=f"profiling {len(lengths)} lengths", unit="length"):
        model_ms.append(profiler.model_ms(length))
        block_ms.append(profiler.block_ms())
        if length == max(lengths):
            saved = profiler.block_saved_bytes()
    block_params = sum(p.numel() for p in profiler.blocks[0].parameters())
    if device.startswith("cuda"):
        memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "lengths": list(lengths),
        "model_ms": model_ms,
        "block_ms": block_ms,
        "layers": len(profiler.blocks),
        "hidden": profiler.hidden,
        "vocab": profiler.vocab,
        "block_params": block_params,
        "block_saved_bytes_per_token": saved / max(lengths),
        "device_memory": memory,
        "device": device,
        "dtype": dtype_name,
    }


def build_table(raw: dict[str, Any], pps: Sequence[int], name: str) -> tuple[CostModel, dict[Degrees, Fit]]:
    """Fit every ``tp1,ppN`` scheme from raw measurements and assemble the cost model."""
    lengths = raw["lengths"]
    layers, hidden = raw["layers"], raw["hidden"]
    fits: dict[Degrees, Fit] = {}
    for pp in pps:
        if pp > layers:
            raise CostModelError(f"pp={pp} exceeds the model's {layers} layers")
        times = (
            [
                math.ceil(layers / pp) * block + max(0.0, whole - layers * block)
                for whole, block in zip(raw["model_ms"], raw["block_ms"])
            ]
            if pp > 1
            else list(raw["model_ms"])
        )
        fits[Degrees(1, pp)] = fit_stage_cost(lengths, times)
    memory = MemoryRegression(
        activation=((1, raw["block_saved_bytes_per_token"] / hidden),),
        bytes_per_layer_h2=16.0 * raw["block_params"] / hidden**2,
        alpha=0.75,
        gap=(("node", 0.0),),
        safe_bound=0.1 * raw["device_memory"],
        gpu_memory=float(raw["device_memory"]),
        hidden=hidden,
        layers=layers,
        vocab=raw["vocab"],
    )
    about = (
        f"Profiled by hgraph profile on {raw['device']} ({raw['dtype']}), lengths {lengths}; "
        "pp>1 from per-block times (see hgraph.profiling.profile)."
    )
    model = CostModel(
        name, {s: f.cost for s, f in fits.items()}, memory, gpus_per_node=1, extra={"_about": about}
    )
    return model, fits
