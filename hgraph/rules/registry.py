"""The sharding-rule registry: op -> rule, with a public ``register`` for users' own ops.

A rule is ``rule(node, rin: RuleInput) -> Decision``. Keys are ATen overloads
(``torch.ops.aten.linear.default``), overload packets (``torch.ops.aten.add``: every overload) or any
Python callable used as a ``call_function`` target. An op without a rule makes ``annotate`` raise
``ShardingRuleError`` naming it — never a silent replicate that would change numerics.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable

import torch

from hgraph.errors import ShardingRuleError
from hgraph.rules.base import op_name

Rule = Callable[..., Any]

_RULES: dict[Any, Rule] = {}
_BY_NAME: dict[str, Rule] = {}  # ops of libraries that register them on import (``transformers::...``)

_BUILTIN_MODULES = ("elementwise", "shape", "linear", "embedding", "attention", "norm", "loss", "indexing", "moe",
                    "scatter_gather", "complex", "conv", "linear_attention", "experts", "einsum")
_loaded = False
_LOAD_LOCK = threading.RLock()


def load_builtin_rules() -> None:
    """Import the built-in rule modules once (they register themselves here; loaded by name, so the
    rule modules import the registry and never the other way round)."""
    global _loaded
    if _loaded:
        return
    with _LOAD_LOCK:  # a second thread must not see the flag before every rule is registered
        if _loaded:
            return
        for name in _BUILTIN_MODULES:
            importlib.import_module(f"hgraph.rules.{name}")
        _loaded = True


def register(op: Any, rule: Rule, *, replace: bool = False) -> None:
    """Register ``rule`` for ``op`` (an ATen overload or packet, or a Python callable).

    Registering an op twice raises unless ``replace=True`` (so two modules cannot silently fight).
    """
    if not callable(rule):
        raise ShardingRuleError(f"rule for {op} must be callable, got {type(rule).__name__}")
    if not (callable(op) or isinstance(op, torch._ops.OpOverloadPacket)):
        raise ShardingRuleError(f"cannot register a rule for {op!r}: expected an ATen op or a callable")
    if op in _RULES and not replace:
        raise ShardingRuleError(f"{op} already has a sharding rule; pass replace=True to override it")
    _RULES[op] = rule


def register_by_name(name: str, rule: Rule) -> None:
    """Register ``rule`` for the op named ``"namespace::op"`` (every overload), for custom ops that
    exist only once their library is imported (transformers' ``grouped_mm_fallback``)."""
    if "::" not in name:
        raise ShardingRuleError(f"op name {name!r} must be 'namespace::op'")
    if name in _BY_NAME:
        raise ShardingRuleError(f"{name} already has a sharding rule")
    _BY_NAME[name] = rule


def unregister(op: Any) -> None:
    """Remove the rule of ``op`` (for tests and plug-ins); missing ops are ignored."""
    _RULES.pop(op, None)


def lookup(op: Any) -> Rule | None:
    """The rule of ``op``: its exact key first, then its overload packet; ``None`` when absent."""
    load_builtin_rules()
    try:
        rule = _RULES.get(op)
    except TypeError:  # unhashable target
        return None
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = _RULES.get(op.overloadpacket) or _BY_NAME.get(op.name().split(".")[0])
    return rule


def registered_ops() -> list[str]:
    """Names of every op with a rule (for documentation and the coverage report)."""
    load_builtin_rules()
    names = [str(op) if isinstance(op, torch._ops.OpOverloadPacket) else op_name(op) for op in _RULES]
    return sorted(names + [name.replace("::", ".") for name in _BY_NAME])
