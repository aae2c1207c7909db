"""Combinations users run, each on two real gloo processes against the unmodified model and
``torch.optim.AdamW`` (``adamw_oracle``), packed (several documents per micro-batch):

* the overlap schedule with context parallelism;
* recomputation with context parallelism;
* held-out evaluation with context parallelism;
* the planner choosing strategies whose pipelines run zero-bubble (``zb1p``);
* a checkpoint of a model with fused projections (Phi-3's ``qkv_proj``, ``gate_up_proj``, cut by
  blocks under tp) loaded into another strategy set (no tp: other optimizer layouts) and trained on.

One launch runs them all in sequence (process start-up is paid once); each test checks its part.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adamw_oracle import assert_matches_reference, single_process_adamw
from test_trainer_oracles import tiny_cost_model
import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.planner.assign import Planner
from hgraph.training.trainer import Trainer
from hgraph.models.zoo import zoo_model
from hgraph.program.options import OverlapConfig
from hgraph.training.configs import AdamWConfig, RunConfig

OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)
PACKED_TOKENS = 32
EXAMPLE = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2, kv_heads=4))


def batches(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (n,), generator=g) for n in batch] for batch in lengths]


DOCUMENTS = [[17, 9, 30, 5, 12, 21], [8, 26, 3, 14, 11, 19]]  # micro-batches of <= 32 hold several
PLANNED = [[20, 18, 22, 19, 21, 20], [39, 3, 3, 4]]  # medium ones go to tp1,pp2 (tiny_cost_model)
HELD_OUT = [[15, 7, 24, 10]]
FUSED = [[13, 5, 21, 9], [17, 3, 11, 7], [6, 25, 14]]  # two steps before the checkpoint, one after


def train(trainer, data, strategy=None):
    losses, params, packing = [], [], []
    for batch in data:
        packing.append(max(len(mb) for mbs in trainer.dispatch([len(s) for s in batch], strategy).micro_batches
                           for mb in mbs))
        losses.append(trainer.step(batch, strategy=strategy))
        params.append(trainer.full_parameters())
    return losses, params, packing


def combinations(checkpoint: str) -> dict:
    """Runs on every rank (module level so spawned processes can import it)."""
    out = {}
    data = batches(DOCUMENTS, seed=1)
    overlap = Trainer(hgraph.compile(make_model(), ["cp2"], example_inputs=EXAMPLE,
                                     options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig()))),
                      optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=PACKED_TOKENS))
    out["overlap_cp"] = train(overlap, data)
    out["evaluate_cp"] = overlap.evaluate(batches(HELD_OUT, seed=3), strategy="cp2")

    recompute = Trainer(hgraph.compile(make_model(), ["cp2"], example_inputs=EXAMPLE,
                                       options=hgraph.CompileOptions(recompute=hgraph.RecomputeConfig("full"))),
                        optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=PACKED_TOKENS))
    out["recompute_cp"] = train(recompute, data)

    compiled = hgraph.compile(make_model(), ["2x tp1", "tp1,pp2"], example_inputs=EXAMPLE,
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(pipeline="zb1p")))
    planner = Planner(tiny_cost_model(), compiled.strategies, comm=None, pipeline_schedule="zb1p")
    planned = Trainer(compiled, planner=planner, optimizer=AdamWConfig(**OPT))
    out["planner_zb1p"] = (*train(planned, batches(PLANNED, seed=2)), [h["strategy"] for h in planned.history])

    fused = batches(FUSED, seed=4)
    before = hgraph.compile(zoo_model("phi3").eval(), ["tp2"], example_inputs=EXAMPLE[:, :8])
    first = Trainer(before, optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=PACKED_TOKENS))
    losses, params, packing = train(first, fused[:2])
    first.save(checkpoint)
    after = hgraph.compile(zoo_model("phi3").eval(), ["2x tp1", "cp2"], example_inputs=EXAMPLE[:, :8])
    second = Trainer(after, optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=PACKED_TOKENS))
    second.load(checkpoint)
    more = train(second, fused[2:], strategy="cp2")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    moved = before.optimizer_layouts[name] != after.optimizer_layouts[name]
    out["checkpoint_fused"] = (losses + more[0], params + more[1], packing + more[2], moved)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return hgraph.launch(combinations, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=900)


def check_training(result, reference):
    losses, params, packing = result[:3]
    assert max(packing) > 1, f"micro-batches {packing} hold one document each"
    assert_matches_reference((losses, params), (reference.losses, reference.params))


def test_overlap_schedule_with_packing_and_cp_equals_adamw(ranks):
    reference = single_process_adamw(make_model(), batches(DOCUMENTS, seed=1), **OPT)
    for rank in ranks:
        check_training(rank["overlap_cp"], reference)


def test_recompute_with_cp_on_real_ranks_equals_adamw(ranks):
    reference = single_process_adamw(make_model(), batches(DOCUMENTS, seed=1), **OPT)
    for rank in ranks:
        check_training(rank["recompute_cp"], reference)


def test_evaluate_with_cp_equals_the_trained_model(ranks):
    model = make_model()
    single_process_adamw(model, batches(DOCUMENTS, seed=1), **OPT)  # trains the model in place
    held = batches(HELD_OUT, seed=3)[0]
    with torch.no_grad():
        total = sum(F.cross_entropy(model(s[None])[0, :-1], s[1:], reduction="sum") for s in held)
    want = float(total) / sum(len(s) - 1 for s in held)
    for rank in ranks:
        assert rank["evaluate_cp"] == pytest.approx(want, rel=1e-5)


def test_planner_with_zero_bubble_pipelines_equals_adamw(ranks):
    reference = single_process_adamw(make_model(), batches(PLANNED, seed=2), **OPT)
    for rank in ranks:
        losses, params, _, chosen = rank["planner_zb1p"]
        assert "tp1,pp2" in chosen, chosen  # a zero-bubble pipeline ran
        assert_matches_reference((losses, params), (reference.losses, reference.params))


def test_checkpoint_with_fused_projections_into_another_strategy_set_equals_adamw(ranks):
    reference = single_process_adamw(zoo_model("phi3").eval(), batches(FUSED, seed=4), **OPT)
    for rank in ranks:
        *result, moved = rank["checkpoint_fused"]
        assert moved  # the fused projection's optimizer layout differs between the two sets
        check_training(result, reference)
