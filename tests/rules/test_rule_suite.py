"""Every registered sharding rule, every input spec it accepts on a 2x2 (cp, tp) mesh, fp64: the
localized forward and vjp equal the single-device op (OpInfo-style, see ``rule_harness``)."""

from __future__ import annotations

import operator

import pytest
import torch
from rule_cases import CASES
from rule_harness import run_case

from hgraph.rules import lookup, registered_ops
from hgraph.rules.base import op_name

DEFAULT_LIMIT = 16  # spec combinations per case in the default run (all single-input ones always; op_db samples: test_rule_opdb.py)
ALL = [(key, c) for key, cases in CASES.items() for c in cases]


def registered_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):  # the overload's own rule first, as lookup does
        return str(target) if str(target) in registered_ops() else str(target.overloadpacket)
    return op_name(target)


# Rules checked end to end instead of op by op: expert parallelism's token movement exists only inside a
# MoE layer rewritten by hgraph.passes.experts on an expert mesh (ep, etp), which a one-op case on the
# (cp, tp) mesh cannot build. tests/compiler/test_expert_parallel.py checks them: simulate equals the
# unmodified model, loss and every gradient, under every ep strategy.
CHECKED_END_TO_END = {
    f"hgraph.runtime.kernels.expert_dispatch.{op}" for op in ("permute_tokens", "dispatch", "combine", "unpermute_tokens")
}


def test_every_registered_rule_has_a_case():
    missing = sorted(set(registered_ops()) - set(CASES) - CHECKED_END_TO_END)
    assert not missing, f"sharding rules with no case in tests/rules/rule_cases.py: {missing}"
    assert not sorted(set(CASES) - set(registered_ops())), "cases for ops that have no rule"


@pytest.mark.parametrize("key, c", ALL, ids=[c.name for _, c in ALL])
def test_case_exercises_its_rule(key, c):
    if key == "_operator.getitem":
        assert lookup(operator.getitem) is not None and isinstance(c.make(torch.Generator()).args[0], torch.Tensor)
        return
    assert registered_name(c.target) == key


@pytest.mark.parametrize("key, c", ALL, ids=[c.name for _, c in ALL])
def test_rule_equals_single_device(key, c):
    outcome = run_case(c.target, c.make, DEFAULT_LIMIT, mesh=c.mesh)
    assert outcome.accepted, f"{c.name}: every input spec was refused ({len(outcome.refused)})"


@pytest.mark.slow
@pytest.mark.parametrize("key, c", ALL, ids=[c.name for _, c in ALL])
def test_rule_equals_single_device_every_spec(key, c):
    outcome = run_case(c.target, c.make, 512, mesh=c.mesh)
    assert outcome.accepted
