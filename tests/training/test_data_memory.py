"""Bounded memory: preparing a corpus and indexing a run over it hold about the same whatever the
corpus' size or the number of times the run reads it.

    python -m pytest -q tests/training/test_data_memory.py

- Preparation of generated corpora of 2 MB and 8 MB, each half one plain-text document and a
  quarter one JSONL line without newlines (the shapes that used to be held and encoded whole),
  in a fresh process under a 6 GB address-space limit: the growth of its resident set (sampled)
  must not grow with the corpus (it did ~4x: 100 -> 390 MB).
- The .bin/.idx writer: the bytes of megatron-core's IndexedDatasetBuilder, and a traced peak
  below 4 bytes per sequence (the builder holds ~100).
- A split read 1000 times: indexed for MAX_INDEX_EPOCHS epochs and read in a cycle, with a
  traced peak no larger than for 100 epochs (megatron-core's own index grows with the epochs).
"""
import importlib
import json
import os
import random
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from megatron_moe.training.data import DataConfig, build_datasets, prepare_data, split_tokens
from megatron_moe.training.data import corpus as data_corpus
from megatron_moe.training.data import datasets as data_datasets
from megatron_moe.training.data import indexed

REPO = Path(__file__).resolve().parents[2]
LIMIT = 6 << 30  # address space of the measured process: a leak fails here, not on the machine


def _text(rng: random.Random, words: list[str], chars: int, sep: str) -> str:
    out, size = [], 0
    while size < chars:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + "." + sep
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


def _corpus(root: Path, megabytes: int) -> list[str]:
    """Half one plain-text document, an eighth one JSONL line without newlines, the rest
    JSONL documents of 200-3000 characters."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    n = megabytes * 1_000_000
    root.mkdir()
    (root / "book.txt").write_text(_text(rng, words, n // 2, "\n"))
    with open(root / "web.jsonl", "w") as f:
        f.write(json.dumps({"text": _text(rng, words, n // 8, " ")}) + "\n")
        size = 0
        while size < 3 * n // 8:
            doc = _text(rng, words, rng.randint(200, 3000), "\n")
            f.write(json.dumps({"text": doc}) + "\n")
            size += len(doc)
    return [str(root / "book.txt"), str(root / "web.jsonl")]


_PREPARE = """
import json, os, sys, threading, time
from megatron_moe.training.data import DataConfig, prepare_data, preparation
import megatron.core.datasets.indexed_dataset  # imported by preparation: not counted
# the constant parts scaled down with the corpora (10M characters of training text, batches
# of 1M): both corpora exceed them, as real ones do, and growth with the corpus stands out
preparation.TOKENIZER_TRAIN_CHARS = preparation.ENCODE_BATCH_CHARS = 200_000

def rss_mb():  # the resident set now (the process's peak, ru_maxrss, is set by the imports)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

peak, done = [rss_mb()], threading.Event()
def sample():
    while not done.wait(0.002):
        peak[0] = max(peak[0], rss_mb())
before = peak[0]
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
cfg = DataConfig(paths=sys.argv[2:], tokenizer_vocab_size=300, cache_dir=sys.argv[1])
p = prepare_data(cfg, workers=2)
done.set(); sampler.join()
print(json.dumps({"growth_mb": max(peak[0], rss_mb()) - before, "tokens": p.num_tokens}))
"""


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _prepare_peak(tmp_path: Path, megabytes: int) -> dict:
    """Peak RSS growth (MB) of prepare_data on a generated corpus, in a fresh process."""
    paths = _corpus(tmp_path / f"corpus{megabytes}", megabytes)
    proc = subprocess.run([sys.executable, "-c", _PREPARE, str(tmp_path / f"cache{megabytes}"),
                           *paths], capture_output=True, text=True, cwd=REPO, timeout=300,
                          preexec_fn=_limit_memory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_preparation_memory_does_not_grow_with_the_corpus(tmp_path):
    small, large = _prepare_peak(tmp_path, 2), _prepare_peak(tmp_path, 8)
    assert large["tokens"] > 3.5 * small["tokens"]  # four times the text, about 4x the tokens
    # the resident set sampled every 2 ms; encoding whole documents or lines grew ~4x (100 -> 390 MB)
    assert large["growth_mb"] < 1.5 * small["growth_mb"] + 30, (small, large)


def test_text_file_is_read_in_blocks(tmp_path, monkeypatch):
    """A 4 MB text file (one document) yields the pieces split_into_sequences cuts from its
    whole text, with their line numbers, holding a few blocks of it, not all of it."""
    rng = random.Random(2)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 8))) for _ in range(500)]
    text = _text(rng, words, 2_000_000, "\n") + "x" * 5000 + _text(rng, words, 2_000_000, " ")
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(data_corpus, "READ_CHARS", 1 << 16)
    tracemalloc.start()
    try:
        peak, pieces = 0, []
        for piece in data_corpus.iter_pieces([tmp_path / "big.txt"]):
            pieces.append((len(piece.text), piece.line, piece.last))
            peak = max(peak, tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
    expected, line = [], 1
    whole = data_corpus.split_into_sequences(text)
    for k, seq in enumerate(whole):
        expected.append((len(seq), line, k == len(whole) - 1))
        line += seq.count("\n")
    assert pieces == expected
    assert peak < len(text) // 4, peak  # measured ~0.5 MB; reading the whole text: over 8 MB


# ----------------------------------------------------------------------------- the writer


def _documents(rng: np.random.Generator, n: int, vocab: int) -> list[list[np.ndarray]]:
    """``n`` documents of 1-4 sequences of 0-40 token ids (empty ones included)."""
    return [[rng.integers(0, vocab, rng.integers(0, 40)) for _ in range(rng.integers(1, 5))]
            for _ in range(n)]


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 50_000), (np.int32, 100_000)])
def test_writer_matches_megatron_builder(tmp_path, monkeypatch, dtype, vocab):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    monkeypatch.setattr(indexed, "_BLOCK", 7)  # pointers computed across many blocks
    docs = _documents(np.random.default_rng(0), 300, vocab)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for doc in docs:
        builder.add_document(np.concatenate(doc), [len(s) for s in doc])
    builder.finalize(str(tmp_path / "ref.idx"))
    seqs = [s.tolist() for doc in docs for s in doc]
    ends = [k == len(doc) - 1 for doc in docs for k in range(len(doc))]
    with indexed.IndexedWriter(tmp_path / "out", dtype) as out:
        for lo in range(0, len(seqs), 37):  # batches that end mid-document
            out.write(seqs[lo:lo + 37], ends[lo:lo + 37])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.idx", "ref.bin", "ref.idx"]
    assert (out.num_sequences, out.num_documents, out.num_tokens) == (
        len(seqs), len(docs), sum(map(len, seqs)))


def test_writer_holds_nothing_per_sequence(tmp_path, monkeypatch):
    importlib.import_module("megatron.core.datasets.indexed_dataset")  # not counted below

    monkeypatch.setattr(indexed, "_BLOCK", 4096)
    batch, n = [[7, 8, 9, 2]] * 1000, 200_000
    tracemalloc.start()
    try:
        with indexed.IndexedWriter(tmp_path / "x", np.uint16) as out:
            for _ in range(n // len(batch)):
                out.write(batch, [True] * len(batch))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.num_sequences == n and os.path.getsize(tmp_path / "x.bin") == n * 4 * 2
    assert peak < 4 * n, peak  # measured ~0.2 MB; the builder's lists: ~20 MB


# ----------------------------------------------------------------------------- the index


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    rng = random.Random(1)
    words = "model expert token router layer block sparse matrix gradient batch".split()
    (root / "docs.jsonl").write_text("".join(
        json.dumps({"text": _text(rng, words, rng.randint(100, 400), "\n")}) + "\n"
        for _ in range(60)))
    cfg = DataConfig(paths=[str(root / "docs.jsonl")], tokenizer_vocab_size=300,
                     cache_dir=str(root / "cache"), split="1,0,0")
    return cfg, prepare_data(cfg)


def _train(prepared, cache: Path, epochs: int, seq: int = 16):
    cfg, prep = prepared
    cfg = DataConfig(paths=cfg.paths, tokenizer_vocab_size=300, cache_dir=str(cache), split="1,0,0")
    n = epochs * prep.num_tokens // seq
    tracemalloc.start()
    try:
        train = build_datasets(cfg, prep, seq_length=seq, seed=1, num_samples=(n, None, None),
                               model_vocab_size=300)[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return train, n, peak


def test_many_epochs_are_indexed_once_and_cycled(prepared, tmp_path):
    _, prep = prepared
    k, seq = data_datasets.MAX_INDEX_EPOCHS, 16
    few, _, _ = _train(prepared, tmp_path / "few", k // 2)
    assert isinstance(few.document_index, np.ndarray)  # megatron-core's own dataset, as before
    assert not isinstance(few, data_datasets.Cycled)
    hundred, _, peak_100 = _train(prepared, tmp_path / "c100", 100)
    train, n, peak_1000 = _train(prepared, tmp_path / "c1000", 1000)
    assert len(train) == n and split_tokens(train) == prep.num_tokens
    # megatron-core's index covers MAX_INDEX_EPOCHS epochs, not 1000: the samples they hold
    assert len(train.document_index) <= k * prep.num_sequences
    period = (k * prep.num_tokens - 1) // seq  # each sample reads one token past its end
    assert len(train.cycled) == period
    for i in (0, 1, period - 1, 5 * period // 3):
        assert train[i + period]["tokens"].tolist() == train[i]["tokens"].tolist()
    assert train[period - 1]["tokens"].tolist() != train[period]["tokens"].tolist()
    with pytest.raises(IndexError):
        train[n]
    # the same index for 100 and 1000 epochs: memory does not grow with the epochs
    assert hundred[7]["tokens"].tolist() == train[7]["tokens"].tolist()
    assert peak_1000 < 1.5 * peak_100, (peak_100, peak_1000)
