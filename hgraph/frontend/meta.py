"""Models built without storage (``with torch.device("meta"): model = ...``): what hgraph needs to
compile and initialise them without ever holding them whole.

* ``fake_parameters``: while a meta model is traced, its parameters are swapped for fake CPU tensors
  (``FakeTensorMode``), so ``torch.export`` sees the shapes, dtypes and device of an eagerly built
  model and captures the same graph; the model's own (meta) parameters are put back afterwards.
* ``materialize_buffers``: buffers computed at construction (rotary ``inv_freq``) hold no values on
  meta; each module owning one is recomputed by the model's own scheme (``init_calls``): HF
  ``_init_weights(module)`` (transformers 5 recomputes rotary tables there), else the module's
  ``reset_parameters()`` (the FSDP2 / torchtune convention). A buffer the scheme does not write
  raises, never left empty.
* ``init_calls``: the model's own initialisation as a sequence of per-module calls, in its order:
  HF models ``initialize_weights()`` (the ``_init_weights`` walk of ``post_init``), other models
  ``reset_parameters()`` of every module that has one, in ``modules()`` order.
* ``release_parameters``: replace every parameter's storage by meta (``Trainer(release_model=True)``).

``Touches`` (a ``TorchDispatchMode``) records which tensors an init call reads or writes, by storage;
``hgraph.frontend.layerwise_init`` uses it to materialise each parameter only while its init needs it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hgraph.errors import InputError

InitCall = Callable[[nn.Module, Callable[[], Any]], None]  # around(module, call): runs ``call`` for ``module``


def is_meta_model(model: nn.Module) -> bool:
    """True when some parameter of ``model`` holds no storage (built or released on meta)."""
    return any(p.is_meta for p in model.parameters())


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage: equal for a parameter, its ``.data`` and its views (meta too)."""
    return tensor.untyped_storage()._cdata


class Touches(TorchDispatchMode):
    """Records, by ``keys`` (storage key -> name), which named tensors the ops inside read or write."""

    def __init__(self, keys: dict[int, str]) -> None:
        super().__init__()
        self.keys = keys
        self.touched: dict[str, None] = {}  # ordered set
        self.written: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema.arguments
        for i, value in enumerate(args):
            self._note(value, i < len(schema) and _writes(schema[i]))
        by_name = {a.name: a for a in schema}
        for name, value in kwargs.items():
            self._note(value, name in by_name and _writes(by_name[name]))
        return func(*args, **kwargs)

    def _note(self, value: Any, write: bool) -> None:
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                name = self.keys.get(storage_key(leaf))
                if name is not None:
                    self.touched[name] = None
                    if write:
                        self.written.add(name)


def _writes(argument: Any) -> bool:
    info = argument.alias_info
    return bool(info is not None and info.is_write)


# ----------------------------------------------------------------------------- the model's own scheme
def _hf_pretrained() -> Any:
    """``transformers.PreTrainedModel`` if transformers is loaded (an HF model means it is), else None."""
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def init_calls(model: nn.Module, around: InitCall) -> None:
    """Run ``model``'s own initialisation, handing every per-module call to ``around(module, call)``.

    HF models: ``initialize_weights()`` exactly as ``post_init`` runs it (children first, each
    sub-model's ``_init_weights``), with every ``_initialize_weights`` call routed through ``around``.
    Other models: ``reset_parameters()`` of each module that defines one, in ``modules()`` order.
    """
    base = _hf_pretrained()
    if base is not None and isinstance(model, base):
        patched = []
        for module in model.modules():
            module.__dict__.pop("_is_hf_initialized", None)  # a walk that ran before would skip them all
            if isinstance(module, base):
                original = module._initialize_weights

                def routed(target: nn.Module, is_custom_code: bool = False, original: Any = original) -> None:
                    around(target, lambda: original(target, is_custom_code))

                module._initialize_weights = routed  # instance attribute: smart_apply looks it up per model
                patched.append(module)
        try:
            model.initialize_weights()
        finally:
            for module in patched:
                del module.__dict__["_initialize_weights"]
        return
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                around(module, reset)


def _module_call(module: nn.Module, parents: dict[int, nn.Module]) -> Callable[[], Any] | None:
    """The scheme's call for ``module`` alone: its HF owner's ``_init_weights`` or its ``reset_parameters``."""
    owner: nn.Module | None = module
    base = _hf_pretrained()
    while owner is not None:
        if base is not None and isinstance(owner, base):
            hf_owner = owner
            return lambda: hf_owner._init_weights(module)
        owner = parents.get(id(owner))
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def materialize_buffers(model: nn.Module) -> list[str]:
    """Recompute every meta buffer of ``model`` on the CPU by the model's own scheme (see the module
    docstring); returns their names. Parameters stay where they are; the global RNG is untouched."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    done: list[str] = []
    for prefix, module in model.named_modules():
        metas = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        names = {n: f"{prefix}.{n}" if prefix else n for n in metas}
        for n in metas:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        call = _module_call(module, parents)
        tracker = Touches({storage_key(module._buffers[n]): names[n] for n in metas})
        if call is not None:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), tracker:
                call()
        missing = [names[n] for n in metas if names[n] not in tracker.written]
        if missing:
            raise InputError(
                f"buffer '{missing[0]}' of module '{prefix}' ({type(module).__name__}) is on the meta device and the "
                "model's own initialisation does not recompute it (no HF _init_weights or reset_parameters() writes "
                f"it); give {type(module).__name__} a reset_parameters() that recomputes its buffers (the FSDP2 / "
                "torchtune convention), or build the model with its buffers on the CPU"
            )
        done += [names[n] for n in metas]
    return done


# ----------------------------------------------------------------------------- tracing and release
@contextlib.contextmanager
def fake_parameters(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s meta parameters are fake CPU tensors of the same shape, stride and
    dtype (tied parameters stay one object); the meta parameters are back afterwards."""
    metas = {id(p): p for p in model.parameters() if p.is_meta}
    if not metas:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = {}
    with mode:
        for key, p in metas.items():
            fake = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
            fakes[key] = nn.Parameter(fake, requires_grad=p.requires_grad)
    swapped = _replace_parameters(model, fakes)
    try:
        yield
    finally:
        for module, name, original in swapped:
            module._parameters[name] = original


def _replace_parameters(model: nn.Module, new: dict[int, nn.Parameter]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Put ``new[id(p)]`` in place of every parameter ``p`` listed, in every module holding it."""
    swapped = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in new:
                swapped.append((module, name, p))
                module._parameters[name] = new[id(p)]
    return swapped


def release_parameters(model: nn.Module) -> None:
    """Free ``model``'s parameter storage: every parameter becomes a meta tensor of its shape and dtype
    (tied parameters stay tied; buffers are kept). The model still traces and names its state."""
    released = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for p in model.parameters() if not p.is_meta}
    _replace_parameters(model, released)


__all__ = [
    "Touches", "fake_parameters", "init_calls", "is_meta_model", "materialize_buffers", "release_parameters",
    "storage_key",
]
