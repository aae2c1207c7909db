"""Planted bugs (issue 37, "nothing lost"): realistic one-line slips in product code, each with the
fast-tier tests (not marked slow) that must fail when it is applied. ``run_mutations.py`` applies each
in a temporary copy of the tree and runs its tests; ``test_mutations.py`` checks every ``find`` still
occurs exactly once, so a refactor that moves the code fails loudly instead of skipping the bug."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    why: str  # what the bug would do to users
    path: str  # relative to the repository root
    find: str  # occurs exactly once in ``path``
    replace: str
    tests: tuple[str, ...]  # fast-tier pytest node ids or files that must fail


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="grad_all_reduce_backward_identity",
        why="Megatron's f (grad_all_reduce) passes the gradient through instead of summing it over the "
            "group: tensor-parallel inputs get one rank's share of their gradient, training silently diverges.",
        path="runtime/kernels/collectives.py",
        find="return torch.ops.hgraph.all_reduce(grad, ctx.mesh_dim, ctx.rc), None, None",
        replace="return grad, None, None",
        tests=("tests/runtime/test_ops.py::test_grad_all_reduce_is_identity_forward_and_sums_gradients",),
    ),
    Mutation(
        name="all_gather_partial_backward_split",
        why="all_gather's adjoint for partial gradients keeps its own chunk instead of reduce-scattering: "
            "every rank drops the other ranks' gradient contributions (K/V under cp, sequence-parallel inputs).",
        path="runtime/kernels/collectives.py",
        find="return torch.ops.hgraph.reduce_scatter(grad, mesh_dim, dim, rc), None, None, None, None",
        replace="return torch.ops.hgraph.split(grad, mesh_dim, dim, rc), None, None, None, None",
        tests=("tests/runtime/test_ops.py::test_all_gather_forward_and_both_backward_modes",),
    ),
    Mutation(
        name="packed_attention_runs_ignore_document_starts",
        why="the sdpa kernel's runs never break at a document start: packed documents attend to each "
            "other, every packed batch trains on leaked context.",
        path="runtime/kernels/attention_kernels.py",
        find="starts = torch.where(positions == 0, index, torch.zeros_like(index)).cummax(dim=0).values[stream]",
        replace="starts = torch.where(positions < 0, index, torch.zeros_like(index)).cummax(dim=0).values[stream]",
        tests=("tests/runtime/test_ops.py::test_packed_attention_equals_per_sequence_attention",),
    ),
    Mutation(
        name="packed_positions_do_not_restart",
        why="pack_micro_batch numbers a packed micro-batch's tokens continuously: positions do not restart "
            "per sequence, so RoPE sees wrong positions and attention treats the pack as one document.",
        path="hgraph/core/batch.py",
        find="        pos.append(torch.arange(len(s)))\n",
        replace="        pos.append(torch.arange(len(s)) + sum(len(x) for x in ids[:-1]))\n",
        tests=("tests/compiler/test_simulate.py::test_simulated_documents_match_each_document_alone",),
    ),
    Mutation(
        name="pointwise_keeps_partial",
        why="every broadcasting pointwise op (gelu, exp, mul, ...) keeps a Partial input Partial: f(a)+f(b) "
            "is taken for f(a+b), so nonlinear ops after a row-parallel matmul give wrong values.",
        path="hgraph/rules/elementwise.py",
        find="return pointwise_decision(node, rin, rin.tensor_inputs(node))\n",
        replace="return pointwise_decision(node, rin, rin.tensor_inputs(node), keep_partial=True)\n",
        tests=("tests/rules/test_rule_suite.py",),
    ),
    Mutation(
        name="zero_chunk_offset",
        why="chunk_bounds starts each ZeRO / sharded chunk one element late: optimizer shards overlap and "
            "leave the first elements of every parameter without an owner.",
        path="hgraph/core/layout.py",
        find="    start = min(index * step, size)\n",
        replace="    start = min(index * step + 1, size)\n",
        tests=("tests/test_layout.py",),
    ),
    Mutation(
        name="dp_gradients_not_reduced",
        why="Push Gradient's layout unions the data-parallel replicas' gradients as duplicates instead of "
            "partial terms: the reduction across pipelines is skipped, each optimizer shard takes one "
            "replica's gradient.",
        path="hgraph/compiler/parameter_plans.py",
        find='unions[key] = (_union(compute, "duplicate"), _union(grads, "partial"))',
        replace='unions[key] = (_union(compute, "duplicate"), _union(grads, "duplicate"))',
        tests=("tests/compiler/test_simulate.py::test_simulated_strategy_matches_reference",),
    ),
    Mutation(
        name="pipeline_receives_before_sends",
        why="the lowering puts each exchange's receives before its sends: neighbouring stages both wait "
            "for the other, pipelines deadlock.",
        path="hgraph/schedule/lowerings.py",
        find="sorted(step, key=lambda a: a.kind not in SENDS)",
        replace="sorted(step, key=lambda a: a.kind in SENDS)",
        tests=("tests/runtime/test_actions.py",),
    ),
    Mutation(
        name="compile_cache_entry_permissions_unchecked",
        why="a compile cache entry file that other users can write is loaded unchecked: anyone sharing "
            "the machine can plant plans every job reading the cache runs.",
        path="hgraph/compiler/compile_cache.py",
        find="problem = None if self.trust_shared else others_can_write(st)",
        replace="problem = None",
        tests=("tests/compiler/test_compile_cache.py::test_an_entry_others_can_write_is_rebuilt_private",),
    ),
    Mutation(
        name="compile_cache_checksum_unchecked",
        why="a compile cache entry's payload is used without checking it against its header's sha256: "
            "a truncated or bit-flipped entry (a full disk, a crashed writer) is decoded into wrong plans "
            "instead of being reported and rebuilt.",
        path="hgraph/compiler/compile_cache.py",
        find='if hashlib.sha256(payload).hexdigest() != header["sha256"]:',
        replace='if not header["sha256"]:',
        tests=("tests/compiler/test_compile_cache.py::test_a_damaged_entry_is_reported_and_rebuilt[flip]",),
    ),
    Mutation(
        name="checkpoint_sha256_unchecked",
        why="loading a checkpoint file skips its sha256 check: a corrupt shard is loaded into the model "
            "and training resumes from damaged weights.",
        path="runtime/checkpoint_manifest.py",
        find='    if digest != entry["sha256"]:\n',
        replace='    if not entry["sha256"]:\n',
        tests=("tests/reliability/test_checkpoint.py::test_corrupt_byte_and_bad_manifest_are_rejected",),
    ),
    Mutation(
        name="adamw_bias_correction_off_by_one",
        why="AdamW's first-moment bias correction uses step + 1: early updates are too large, results "
            "differ from torch.optim.AdamW.",
        path="runtime/optimizer.py",
        find="bias1 = 1 - beta1**step",
        replace="bias1 = 1 - beta1 ** (step + 1)",
        tests=("tests/runtime/test_optimizer.py::test_matches_torch_adamw_exactly",),
    ),
    Mutation(
        name="zero_replicated_grad_norm_counted_per_rank",
        why="the ZeRO optimizer's global gradient norm counts a replicated (unsharded) parameter's "
            "gradient on every rank instead of once: gradient clipping scales by a norm too large, "
            "updates differ from torch's clip_grad_norm_ + AdamW.",
        path="runtime/optimizer.py",
        find="if g is None or (name in self.replicated and comm.rank != world[0]):",
        replace="if g is None:",
        tests=("tests/runtime/test_optimizer.py::test_global_norm_over_ranks_counts_replicated_once",),
    ),
    Mutation(
        name="zero_layout_replicates_dim0_parameters",
        why="the fixed ZeRO layout treats a parameter cut along dim 0 like a scalar and replicates it: "
            "most weights' fp32 masters and AdamW states are held whole on every rank (no ZeRO memory "
            "saving) and their updates are computed world-size times.",
        path="hgraph/core/zero.py",
        find="    if dim < 0:\n",
        replace="    if dim <= 0:\n",
        tests=("tests/lnk/test_scale.py",),
    ),
    Mutation(
        name="vocab_parallel_target_not_shifted",
        why="vocab-parallel cross-entropy indexes a shard with the global target id: ranks past the first "
            "pick the wrong logit, the loss and its gradient are wrong under tp.",
        path="runtime/kernels/vocab_parallel.py",
        find="local = torch.where(inside, targets - start, torch.zeros_like(targets))",
        replace="local = torch.where(inside, targets, torch.zeros_like(targets))",
        tests=("tests/runtime/test_ops.py::test_vocab_parallel_cross_entropy_matches_cross_entropy",),
    ),
    Mutation(
        name="lnk_collective_groups",
        why="LNK's collective groups keep the changed mesh coordinate: every group is one rank, so the "
            "planned all-gathers/reduce-scatters exchange nothing and ranks hold wrong pieces.",
        path="hgraph/lnk/collectives.py",
        find="groups.setdefault(coords[:m] + coords[m + 1 :], []).append(rank)",
        replace="groups.setdefault(coords[:m] + coords[m:], []).append(rank)",
        tests=("tests/lnk/test_golden.py", "tests/lnk/test_solver.py"),
    ),
    Mutation(
        name="planner_packing_capacity_strict",
        why="first-fit-decreasing packing compares a sequence's length to a micro-batch's room with < "
            "instead of <=: a sequence that exactly fills the room opens a new micro-batch, plans use more "
            "micro-batches than fit and every iteration pays their overhead.",
        path="hgraph/planner/packing.py",
        find="            if l <= r:\n",
        replace="            if l < r:\n",
        tests=("tests/planner/test_assign.py::test_pack_pp1_uses_as_few_micro_batches_as_fit",),
    ),
    Mutation(
        name="cast_keeps_partial",
        why="every cast keeps a Partial input Partial: a cast to an integer type truncates each rank's piece "
            "(the sum of truncated pieces is off by 1 or 2 per element), a cast to a narrower float rounds "
            "each piece (the sum loses the digits its larger pieces cancel).",
        path="hgraph/rules/elementwise.py",
        find="keep_partial=bool(inputs) and _exact_cast(inputs[0], node))",
        replace="keep_partial=bool(inputs))",
        tests=("tests/rules/test_rule_opdb.py", "tests/rules/test_rule_properties.py"),
    ),
    Mutation(
        name="squeeze_drops_local_size_one",
        why="squeeze() with no dims runs as squeeze() on each rank: a cut dim whose local piece has size 1 "
            "is dropped too, and the rank holds a shape its spec does not describe.",
        path="hgraph/rules/shape.py",
        find="    if shape:\n        decision.target, decision.args, decision.kwargs = aten.squeeze.dims",
        replace="    if False:\n        decision.target, decision.args, decision.kwargs = aten.squeeze.dims",
        tests=("tests/rules/test_rule_opdb.py", "tests/rules/test_rule_properties.py"),
    ),
)
