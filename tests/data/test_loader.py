"""hgraph.data on real files: every format, both tokenizer kinds, token budgets, exact resume."""

import json

import pytest
import torch

from hgraph.errors import InputError
from hgraph.data import DocumentSource, TokenLoader, load_tokenizer, stdlib_corpus, stdlib_tokenizer

DOCS = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n" * 40, "class A:\n    pass\n",
        "for i in range(10):\n    print(i)\n" * 3]


@pytest.fixture(scope="module")
def tok():
    return stdlib_tokenizer()


def _expected(tok, texts):
    return [ids + [tok.eos_id] for ids in tok.encode_batch(texts)]


def test_text_files_one_document_each(tmp_path, tok):
    for i, d in enumerate(DOCS):
        (tmp_path / f"d{i}.txt").write_text(d)
    src = DocumentSource.from_paths([str(tmp_path)], "text")
    assert sorted(src.documents()) == sorted(DOCS)


def test_lines_jsonl_parquet_give_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d.replace("\n", " ") for d in DOCS]
    (tmp_path / "c.txt").write_text("\n".join(docs) + "\n\n")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"content": docs}), tmp_path / "c.parquet")
    assert list(DocumentSource.from_paths([str(tmp_path / "c.txt")], "lines").documents()) == docs
    assert list(DocumentSource.from_paths([str(tmp_path / "c.jsonl")], "jsonl", "content").documents()) == docs
    assert list(DocumentSource.from_paths([str(tmp_path / "c.parquet")], "parquet", "content").documents()) == docs
    with pytest.raises(InputError, match="no field 'text'"):
        list(DocumentSource.from_paths([str(tmp_path / "c.jsonl")], "jsonl").documents())


def test_bad_data_one_line_errors(tmp_path):
    with pytest.raises(InputError, match="nope.txt.*no such file"):
        DocumentSource.from_paths([str(tmp_path / "nope.txt")])
    (tmp_path / "ok.txt").write_text("fine\n")
    (tmp_path / "bad.txt").write_bytes(b"abc \xff\xfe def\n")
    src = DocumentSource.from_paths([str(tmp_path)], "text")
    with pytest.raises(InputError, match=r"bad.txt: byte 4 \(0xff\) is not valid UTF-8"):
        list(src.documents())


def test_empty_corpus(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    loader = TokenLoader(DocumentSource.from_paths([str(tmp_path / "empty.txt")]), tok, 16, 64)
    with pytest.raises(InputError, match="corpus is empty"):
        loader.next_batch()


def test_batches_cover_every_token_once_per_epoch(tmp_path, tok):
    for i, d in enumerate(DOCS):
        (tmp_path / f"d{i}.txt").write_text(d)
    src = DocumentSource.from_paths([str(tmp_path)])
    loader = TokenLoader(src, tok, context=32, tokens_per_batch=80, seed=3, window=2, max_epochs=1)
    batches = list(loader)
    assert all(sum(len(s) for s in b) <= 80 for b in batches)
    assert all(2 <= len(s) <= 32 for b in batches for s in b)
    got = sorted(tuple(s.tolist()) for b in batches for s in b)
    want = sorted(tuple(ids[i : i + 32]) for ids in _expected(tok, DOCS) for i in range(0, len(ids), 32)
                  if len(ids[i : i + 32]) >= 2)
    assert got == want  # split: every token of every document exactly once
    cut = TokenLoader(src, tok, context=32, tokens_per_batch=80, long_documents="cut", max_epochs=1)
    assert sorted(tuple(s.tolist()) for b in cut for s in b) == sorted(tuple(i[:32]) for i in _expected(tok, DOCS))
    other = TokenLoader(src, tok, context=32, tokens_per_batch=80, seed=4, window=2, max_epochs=1)
    assert [len(s) for b in other for s in b] != [len(s) for b in batches for s in b]  # the seed orders


def test_auto_tokenizer_directory(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=tok.path, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "tok")
    auto = load_tokenizer(str(tmp_path / "tok"))
    assert auto.vocab_size == tok.vocab_size and auto.eos_id == tok.eos_id
    assert auto.encode_batch(DOCS) == tok.encode_batch(DOCS)
    with pytest.raises(InputError, match="vocabulary is 256"):
        auto.check_vocab(256)


def test_resume_yields_the_same_batches():
    train, _ = stdlib_corpus()
    tok = stdlib_tokenizer()
    make = lambda: TokenLoader(train, tok, context=256, tokens_per_batch=1024, seed=1, window=8)  # noqa: E731
    straight = make()
    ref = [straight.next_batch() for _ in range(12)]
    first = make()
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    rest = [resumed.next_batch() for _ in range(7)]
    for a, b in zip(ref[5:], rest):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(InputError, match="seed: saved 1, now 2"):
        TokenLoader(train, tok, context=256, tokens_per_batch=1024, seed=2, window=8).load_state_dict(state)


def test_stdlib_corpus_is_real_and_split():
    train, held = stdlib_corpus()
    assert len(train.files) > 1000 and 20 < len(held.files) < len(train.files) // 10
    assert not set(train.files) & set(held.files)
