"""Profile caches are data with a checksum: a truncated, corrupt or foreign entry is rebuilt with a
warning naming its file; jobs sharing ``$HGRAPH_CACHE`` never read a partial entry."""

import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

from hgraph.core.cache_entry import CacheWarning, load_entry, store_entry
from hgraph.core.degrees import Degrees
from hgraph.errors import CostModelError
from hgraph.models import Llama, LlamaConfig
from hgraph.profiling.profile_ranks import measure_ranks

KEY = {"model": "tiny", "lengths": [16, 32, 64]}
DATA = {"per_rank": [[1.0, 2.0]], "seconds": 3.0}


def tiny_llama():
    return Llama(LlamaConfig(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))


def test_a_stored_entry_reads_back(tmp_path):
    store_entry(tmp_path / "e.json", "profile", KEY, DATA)
    assert load_entry(tmp_path / "e.json", "profile", KEY, ("per_rank",)) == DATA
    assert load_entry(tmp_path / "absent.json", "profile", KEY) is None


@pytest.mark.parametrize("damage, reason", [
    (lambda blob: blob[: len(blob) - 7], "checksum"),
    (lambda blob: b'{"per_rank": [1]', "no header"),
    (lambda blob: b"", "no header"),
])
def test_a_damaged_entry_is_rebuilt_with_a_warning_naming_the_file(tmp_path, damage, reason):
    path = tmp_path / "e.json"
    store_entry(path, "profile", KEY, DATA)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.warns(CacheWarning, match=rf"{re.escape(str(path))} ignored and rebuilt: .*{reason}"):
        assert load_entry(path, "profile", KEY) is None


@pytest.mark.parametrize("kind, key, required, reason", [
    ("profile-ranks", KEY, (), "not a profile cache entry"),
    ("profile", {**KEY, "lengths": [8]}, (), "another key"),
    ("profile", KEY, ("per_rank", "layers"), "lacks \\['layers'\\]"),
])
def test_a_foreign_entry_is_rebuilt_with_a_warning(tmp_path, kind, key, required, reason):
    path = tmp_path / "e.json"
    store_entry(path, kind, key, DATA)
    with pytest.warns(CacheWarning, match=reason):
        assert load_entry(path, "profile", KEY, required) is None


def test_measure_ranks_names_a_truncated_entry_and_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path))
    args = (tiny_llama, 2, [Degrees.parse("tp1")], [16, 32, 64])
    with pytest.raises(CostModelError, match="looked for") as missing:
        measure_ranks(*args, measure=False)
    path = re.search(r"looked for (\S+)\)", str(missing.value)).group(1)
    pathlib.Path(path).parent.mkdir(parents=True)
    pathlib.Path(path).write_text('{"per_rank": [')  # what a plain write_text left when killed
    with pytest.warns(CacheWarning, match=re.escape(path)), pytest.raises(CostModelError, match="looked for"):
        measure_ranks(*args, measure=False)


_WRITER = textwrap.dedent("""
    import sys
    from hgraph.core.cache_entry import store_entry
    for i in range(40):
        store_entry(sys.argv[1], "profile", {"k": 1}, {"writer": sys.argv[2], "i": i, "pad": "x" * 100000})
""")


def test_two_jobs_writing_one_entry_never_show_a_partial_one(tmp_path):
    path = tmp_path / "e.json"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name]) for name in "ab"]
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # a partial entry would warn
        while any(w.poll() is None for w in writers):
            entry = load_entry(path, "profile", {"k": 1}, ("writer", "i"))
            if entry is not None:
                seen.add(entry["writer"])
    assert [w.wait() for w in writers] == [0, 0]
    assert load_entry(path, "profile", {"k": 1}) is not None and seen
    assert [p.name for p in tmp_path.iterdir()] == ["e.json"]
