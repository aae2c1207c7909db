"""Initialise a meta model by its own scheme, one module at a time, never holding it whole.

Contract (tested in tests/compiler/test_layerwise_init.py): ``initialize(model, seed, on_ready)``
hands ``on_ready(fqn, value)`` every parameter with exactly the value, bit for bit, that this gives
on the same model in one process::

    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.initialize_weights()            # HF models: the _init_weights walk post_init runs
    # other models: for m in model.modules(): m.reset_parameters()   (where defined)

i.e. the model's own scheme (``hgraph.frontend.meta.init_calls``) in its own order, from ``seed``. This is not
the value ``torch.manual_seed(seed); AutoModelForCausalLM.from_config(cfg)`` leaves: eager
construction draws random numbers (``nn.Linear`` / ``nn.Embedding`` defaults) before ``post_init``
overwrites them, so its draws come later in the stream; the distributions are the same.

How: a dry run of the scheme on the meta model records, per call, which parameters it reads or
writes (``hgraph.frontend.meta.Touches``; meta ops draw no random numbers). The real run then materialises a
parameter on the CPU just before its first call, and hands it to ``on_ready`` and frees it right after
its last: for HF Llama one ``nn.Linear`` at a time; GPT-2's block re-initialises its children's
``c_proj``, so that one lives across its block. A parameter no call writes raises ``InputError``
(never an uninitialised value). The global RNG is restored afterwards.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import nn

from hgraph.errors import InputError
from hgraph.frontend.meta import Touches, init_calls, storage_key

OnReady = Callable[[str, torch.Tensor], None]
# The walk draws from torch's process-wide generator: simulated-rank threads take turns.
_WALK_LOCK = threading.Lock()


class _Holders:
    """Every module slot holding each parameter (tied ones have several), to swap its storage."""

    def __init__(self, model: nn.Module) -> None:
        self.canonical = {id(p): fqn for fqn, p in model.named_parameters()}
        self.original = {fqn: p for fqn, p in model.named_parameters()}
        self.slots: dict[str, list[tuple[nn.Module, str]]] = {fqn: [] for fqn in self.original}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in self.canonical:
                    self.slots[self.canonical[id(p)]].append((module, name))

    def put(self, fqn: str, value: nn.Parameter) -> None:
        for module, name in self.slots[fqn]:
            module._parameters[name] = value


def initialize(model: nn.Module, seed: int, on_ready: OnReady, names: Any = None) -> None:
    """Run ``model``'s own initialisation from ``seed`` (see the module docstring) and call
    ``on_ready(fqn, value)`` once per meta parameter (canonical names; ``names``: only those)."""
    with _WALK_LOCK:  # also while reading the slots: another rank's walk swaps live tensors into them
        holders = _Holders(model)
        metas = {fqn: p for fqn, p in holders.original.items() if p.is_meta}
        wanted = set(metas if names is None else names)
        keys = {storage_key(p): fqn for fqn, p in metas.items()}
        touches = _dry_run(model, keys)
        written = set().union(*(w for _, w in touches)) if touches else set()
        missing = [fqn for fqn in metas if fqn not in written]
        if missing:
            raise InputError(
                f"parameter '{missing[0]}' ({len(missing)} in all) is not written by {type(model).__name__}'s own "
                "initialisation (HF _init_weights / reset_parameters); hgraph cannot initialise it on the meta "
                "device: give the Trainer weights=PATH, or give its module a reset_parameters()"
            )
        last = {fqn: i for i, (touched, _) in enumerate(touches) for fqn in touched}
        _real_run(model, seed, touches, last, holders, metas, wanted, on_ready)


def _dry_run(model: nn.Module, keys: dict[int, str]) -> list[tuple[list[str], set[str]]]:
    """Per init call, in order: the meta parameters it touches and those it writes."""
    touches: list[tuple[list[str], set[str]]] = []

    def record(module: nn.Module, call: Callable[[], Any]) -> None:
        tracker = Touches(keys)
        with tracker:
            call()
        touches.append((list(tracker.touched), tracker.written))

    with torch.random.fork_rng(devices=[]):
        init_calls(model, record)
    return touches


def _real_run(model: nn.Module, seed: int, touches: list[tuple[list[str], set[str]]], last: dict[str, int],
              holders: _Holders, metas: dict[str, nn.Parameter], wanted: set[str], on_ready: OnReady) -> None:
    live: dict[str, nn.Parameter] = {}
    index = 0

    def run(module: nn.Module, call: Callable[[], Any]) -> None:
        nonlocal index
        if index >= len(touches):
            raise InputError(f"{type(model).__name__}'s initialisation made more calls than its dry run on the meta "
                             "device; it depends on parameter values and cannot run layer by layer")
        touched = touches[index][0]
        for fqn in touched:
            if fqn not in live:
                meta = metas[fqn]
                live[fqn] = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype), requires_grad=meta.requires_grad)
                holders.put(fqn, live[fqn])
        call()
        for fqn in touched:
            if last[fqn] == index:
                value = live.pop(fqn)
                holders.put(fqn, metas[fqn])
                if fqn in wanted:
                    on_ready(fqn, value.detach())
        index += 1

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            init_calls(model, run)
    finally:
        for fqn in list(live):
            holders.put(fqn, metas[fqn])
    if index != len(touches):
        raise InputError(f"{type(model).__name__}'s initialisation made fewer calls than its dry run on the meta "
                         "device; it depends on parameter values and cannot run layer by layer")


__all__ = ["initialize"]
