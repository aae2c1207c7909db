"""The on-disk compile cache: a second compile of the same model, strategies and options reads its
plans from disk and they equal a compile without the cache (the oracle: plans built from scratch);
a corrupt, truncated or malformed entry is reported and rebuilt; another strategy list or option is
another key. Entries are data: a planted pickle with a valid checksum is never run, fuzzed entries
are rebuilt, and a directory other users can write is refused."""

import hashlib
import json
import os
import pickle
import random

import pytest
import torch

import hgraph
from hgraph.compiler.compile_cache import ENV, CacheWarning, CompileCache
from hgraph.errors import InputError
from hgraph.models import Llama, LlamaConfig
from hgraph.program.plan_codec import decode_plans

STRATEGIES = ["4x tp2", "tp4 + 2x tp2"]


def _compile(strategies=STRATEGIES, compute_dtype=None, **build):
    """The test model compiled with ``build`` (``BuildConfig``'s fields)."""
    model = Llama(LlamaConfig(layers=2, kv_heads=4), seed=0)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    options = hgraph.CompileOptions(compute_dtype=compute_dtype, build=hgraph.BuildConfig(**build))
    return hgraph.compile(model, strategies, ids, options=options)


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


def _entry(directory):
    (name,) = os.listdir(directory)
    return os.path.join(directory, name)


def _plant(path, payload: bytes) -> None:
    """Replace the entry at ``path`` by ``payload`` and rewrite its checksum to match, as someone who
    can write the cache can (also in the pickle framing of hgraph 0.1, where this ran the payload)."""
    with open(path, "rb") as fh:
        blob = fh.read()
    digest = hashlib.sha256(payload).hexdigest()
    if path.endswith(".pkl"):  # magic line, sha256, key, pickle
        head = len(b"hgraph-compile-cache\n")
        blob = blob[:head] + digest.encode() + blob[head + 64:head + 128] + payload
    else:  # header line (format, key, sha256), payload
        header = json.loads(blob.partition(b"\n")[0])
        blob = json.dumps({**header, "sha256": digest}).encode() + b"\n" + payload
    with open(path, "wb") as fh:
        fh.write(blob)


class _CreatesFile:
    """Unpickling this creates ``path``: a stand-in for any code a pickle can run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_pickle_with_a_valid_checksum_is_not_run(tmp_path):
    cache, marker = tmp_path / "cache", tmp_path / "ran"
    fresh = _compile(rank=1)
    _compile(rank=1, cache_dir=str(cache))
    _plant(_entry(cache), pickle.dumps(_CreatesFile(str(marker))))
    with pytest.warns(CacheWarning, match="ignored and rebuilt"):
        rebuilt = _compile(rank=1, cache_dir=str(cache))
    assert not marker.exists()
    assert not rebuilt.cache_hit and _products(rebuilt, 1) == _products(fresh, 1)
    assert _compile(rank=1, cache_dir=str(cache)).cache_hit  # rewritten as data


@pytest.mark.parametrize("damage", ["flip", "wrong_shape", pytest.param("truncate", marks=pytest.mark.slow),
                                    pytest.param("garbage", marks=pytest.mark.slow)])
def test_a_damaged_entry_is_reported_and_rebuilt(tmp_path, damage):
    fresh = _compile(rank=1)
    _compile(rank=1, cache_dir=str(tmp_path))
    path = _entry(tmp_path)
    blob = bytearray(open(path, "rb").read())
    if damage == "flip":  # a move's byte count: still JSON of the right shape, only the checksum sees it
        at = blob.rindex(b'"bytes":') + len(b'"bytes":')
        blob[at] = ord("1") + int(chr(blob[at])) % 9
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "garbage":
        blob = bytearray(b"not a cache entry")
    if damage == "wrong_shape":  # valid JSON, valid checksum: a layout where a plan should be
        data = json.loads(blob.partition(b"\n")[2])
        data["plans"][0] = data["layouts"][0]
        _plant(path, json.dumps(data).encode())
    else:
        open(path, "wb").write(bytes(blob))
    with pytest.warns(CacheWarning, match="ignored and rebuilt"):
        rebuilt = _compile(rank=1, cache_dir=str(tmp_path))
    assert not rebuilt.cache_hit and _products(rebuilt, 1) == _products(fresh, 1)
    assert _compile(rank=1, cache_dir=str(tmp_path)).cache_hit  # rewritten


# ------------------------------------------------------------------------------------------ fuzzing
_OTHER = {"number": ["7", None, True, [], {}], "str": [3, None, False, ["x"], {"x": 1}],
          "bool": [0, "true", None, []], "null": [0, "", False, []], "list": [{}, 1, "x", None],
          "dict": [[], 1, "x", None]}


def _kind(value):
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "str", list: "list", dict: "dict", type(None): "null"}[type(value)]


def _places(node, parent=None, key=None, free=False):
    """Every (parent, key, value, keys of the parent are free) in ``node``, depth first."""
    if parent is not None:
        yield parent, key, node, free
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    # the parameter table of a program (programs[i][2]) may hold any names: no keys removed or added
    free_here = isinstance(node, dict) and isinstance(parent, list) and key == 2
    for k, child in children:
        yield from _places(child, node, k, free_here)


def _mutate(data, rng):
    """A copy of ``data`` with one value (anywhere, uniformly) replaced by a value of another JSON
    type, or one key of a fixed-schema object removed or added, or a fixed-length row made longer or
    shorter."""
    data = json.loads(json.dumps(data))
    parent, key, node, free = rng.choice(list(_places(data)))
    choice = rng.random()
    if isinstance(parent, dict) and not free and choice < 0.1:
        del parent[key]
    elif isinstance(parent, dict) and not free and choice < 0.2:
        parent["unexpected"] = 1
    elif isinstance(parent, list) and parent and isinstance(parent[0], str) and choice < 0.4:
        parent.append(parent[-1]) if rng.random() < 0.5 else parent.pop()  # a step row, tagged by kind
    else:
        parent[key] = rng.choice(_OTHER[_kind(node)])
    return data


@pytest.fixture(scope="module")
def stored_entry(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cache")
    _compile(rank=1, cache_dir=str(directory))
    path = _entry(directory)
    with open(path, "rb") as fh:
        return directory, os.path.basename(path)[: -len(".json")], fh.read()


def _load(directory, key, payload: bytes):
    path = os.path.join(directory, f"{key}.json")
    _plant(path, payload)
    return CompileCache(str(directory), key).load(decode_plans)


def test_the_stored_entry_is_json_data(stored_entry):
    directory, key, blob = stored_entry
    header, _, payload = blob.partition(b"\n")
    assert json.loads(header)["key"] == key
    assert set(json.loads(payload)) == {"topologies", "layouts", "plans", "programs"}
    assert _load(directory, key, payload) is not None


def test_fuzzed_entries_are_reported_not_used(stored_entry):
    """Truncated, random bytes, JSON of the wrong shape (each with a valid checksum: the checksum
    alone would catch damage in transit): every one is warned about and not used."""
    directory, key, blob = stored_entry
    payload = blob.partition(b"\n")[2]
    data = json.loads(payload)
    rng = random.Random(0)
    cases = [payload[: rng.randrange(len(payload))] for _ in range(20)]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(20)]
    cases += [b"null", b"[]", b"{}", b"1", b'"plans"', b"[" * 100_000 + b"]" * 100_000,
              payload.replace(b"150000000000.0", b"NaN", 1)]
    cases += [json.dumps(_mutate(data, rng)).encode() for _ in range(300)]
    used = []
    for i, case in enumerate(cases):
        with pytest.warns(CacheWarning, match="ignored and rebuilt"):
            if _load(directory, key, case) is not None:
                used.append(i)
    assert not used, [cases[i][:200] for i in used]


# -------------------------------------------------------------------------------------- permissions
@pytest.mark.parametrize("mode", [0o775, 0o757], ids=["group-writable", "other-writable"])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(InputError, match=f"chmod go-w {shared}"):
        _compile(rank=0, cache_dir=str(shared))
    assert os.listdir(shared) == []
    trusted = _compile(rank=0, cache_dir=str(shared), trust_shared_cache=True)  # said explicitly
    assert not trusted.cache_hit and len(os.listdir(shared)) == 1


def test_an_entry_others_can_write_is_rebuilt_private(tmp_path):
    _compile(rank=0, cache_dir=str(tmp_path))
    path = _entry(tmp_path)
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o666)
    with pytest.warns(CacheWarning, match="writable by its group and others"):
        assert not _compile(rank=0, cache_dir=str(tmp_path)).cache_hit
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert _compile(rank=0, cache_dir=str(tmp_path)).cache_hit
