"""The on-disk compile cache: a second compile of the same model, strategies and options reads its
plans from disk and they equal a compile without the cache (the oracle: plans built from scratch);
a corrupt or truncated entry is reported and rebuilt; another strategy list or option is another key."""

import os

import pytest
import torch

import hgraph
from hgraph.compiler.compile_cache import ENV, CacheWarning
from hgraph.models import Llama, LlamaConfig

STRATEGIES = ["4x tp2", "tp4 + 2x tp2"]


def _compile(**kw):
    model = Llama(LlamaConfig(layers=2, kv_heads=4), seed=0)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    return hgraph.compile(model, kw.pop("strategies", STRATEGIES), example_inputs=ids, **kw)


def _products(compiled, rank):
    out = []
    for index in range(len(compiled.strategies)):
        for pc in compiled.program(index, rank).pulls:
            for sub in (pc.pull, pc.push):
                out.append((str(sub), str(sub.plan), sub.plan.steps_for(rank), sub.bytes, sub.plan.first_round))
    return out


def test_second_compile_hits_the_cache_with_equal_products(tmp_path):
    fresh = _compile(rank=2)
    first = _compile(rank=2, cache_dir=str(tmp_path))
    second = _compile(rank=2, cache_dir=str(tmp_path))
    assert not first.cache_hit and second.cache_hit
    assert len(os.listdir(tmp_path)) == 1
    assert not any(r.name.startswith("plan[") for r in second.pass_history)  # nothing planned
    assert _products(second, 2) == _products(fresh, 2)
    assert _products(second, 5) == _products(fresh, 5)  # other ranks still built on demand


def test_environment_variable_and_other_keys(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    assert not _compile(rank=0).cache_hit
    assert _compile(rank=0).cache_hit
    assert not _compile(rank=1).cache_hit  # another rank
    assert not _compile(rank=0, strategies=STRATEGIES[:1]).cache_hit  # other strategies
    assert not _compile(rank=0, compute_dtype=torch.bfloat16).cache_hit  # other options
    assert len(os.listdir(tmp_path)) == 4


@pytest.mark.parametrize("damage", ["flip", pytest.param("truncate", marks=pytest.mark.slow),
                                    pytest.param("garbage", marks=pytest.mark.slow)])
def test_a_damaged_entry_is_reported_and_rebuilt(tmp_path, damage):
    fresh = _compile(rank=1)
    _compile(rank=1, cache_dir=str(tmp_path))
    (path,) = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    blob = bytearray(open(path, "rb").read())
    if damage == "flip":
        blob[-10] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob = bytearray(b"not a cache entry")
    open(path, "wb").write(bytes(blob))
    with pytest.warns(CacheWarning, match="ignored and rebuilt"):
        rebuilt = _compile(rank=1, cache_dir=str(tmp_path))
    assert not rebuilt.cache_hit and _products(rebuilt, 1) == _products(fresh, 1)
    assert _compile(rank=1, cache_dir=str(tmp_path)).cache_hit  # rewritten
