"""Data pipeline: documents -> tokenizer -> .bin/.idx -> GPTDataset splits, cache, CLI, errors.

    python -m pytest -q tests/training/test_data.py

References are independent of megatron_moe.training.data: token streams are rebuilt from the
tokenizer's own encode(), GPT-2 BPE ids are worked out by hand for a vocabulary the test
writes, and the pre-tokenizer is compared with GPT-2's regex (when `regex` is installed).
"""
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_moe.training.data import config as data_config
from megatron_moe.training.data import corpus as data_corpus
from megatron_moe.training.data import preparation, tokenizers
from megatron_moe.training.data import DataConfig, build_datasets, prepare_data, split_tokens

WORDS = ("the of and to in is was for on that with as by at from his her they this which "
         "model expert token router layer block sparse matrix gradient batch sequence "
         "attention weight bias loss value train valid test data cache file line word").split()


def _doc(rng: random.Random, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ""]))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus: 30 JSONL documents and 10 text files, each under SEQUENCE_CHARS."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [_doc(rng, rng.randint(3, 20)) for _ in range(40)]
    assert all(len(d) < data_corpus.SEQUENCE_CHARS for d in docs)
    with open(root / "part.jsonl", "w") as f:
        for i, d in enumerate(docs[:30]):
            f.write(json.dumps({"text": d, "meta": {"i": i}}) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are skipped
    (root / "txt").mkdir()
    for i, d in enumerate(docs[30:]):
        (root / "txt" / f"doc{i:02d}.txt").write_text(d)
    (root / "txt" / "ignored.bin").write_bytes(b"\x00\x01")  # not a text suffix: skipped
    return root, docs


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """The tokenizer is trained once for the module (vocabulary 400)."""
    root, _ = corpus
    cfg = DataConfig(paths=[str(root / "part.jsonl"), str(root / "txt")],
                     tokenizer_vocab_size=400, cache_dir=str(tmp_path_factory.mktemp("cache")))
    return cfg, prepare_data(cfg)


def _seq_tokens(tok, docs):
    """Expected token ids of each stored sequence (one per document here) with its EOD."""
    return [tok.encode(d) + [tok.eod_id] for d in docs]


# ---------------------------------------------------------------------------------------------
# Round trip and documents
# ---------------------------------------------------------------------------------------------


def test_round_trip_text_to_gptdataset_samples(prepared, corpus):
    cfg, prep = prepared
    _, docs = corpus
    tok = prep.tokenizer()
    assert (prep.vocab_size, prep.eod_id, prep.num_documents) == (400, tok.eod_id, 40)
    expected = _seq_tokens(tok, docs)
    assert prep.num_tokens == sum(map(len, expected))
    for d in docs:
        assert tok.decode(tok.encode(d)) == d

    cfg1 = DataConfig(paths=cfg.paths, tokenizer_vocab_size=400, cache_dir=cfg.cache_dir,
                      split="1,0,0")
    L = 16
    train, valid, test = build_datasets(cfg1, prep, seq_length=L, seed=7,
                                        num_samples=(None, None, None), model_vocab_size=512)
    assert valid is None and test is None
    stream = np.concatenate([expected[i] for i in train.document_index])
    assert len(train) == (len(stream) - 1) // L  # one epoch, last partial sequence dropped
    for k in range(len(train)):
        sample = train[k]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        j = int(train.shuffle_index[k])
        window = stream[j * L:(j + 1) * L + 1]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
        assert sample["loss_mask"].tolist() == [1.0] * L
        assert sample["position_ids"].tolist() == list(range(L))
    # all samples of the epoch together are the stream, so the text decodes back
    ordered = [train[int(k)] for k in np.argsort(train.shuffle_index)]
    tokens = np.concatenate([s["tokens"].numpy() for s in ordered])
    first = train.document_index[0]
    assert tok.decode(tokens[:len(expected[first]) - 1].tolist()) == docs[first]


def test_jsonl_and_plain_text_documents(corpus):
    root, docs = corpus
    files = data_corpus.resolve_inputs([str(root / "part.jsonl"), str(root / "txt")])
    assert [f.name for f in files] == ["part.jsonl"] + [f"doc{i:02d}.txt" for i in range(10)]
    assert list(data_corpus.iter_documents(files)) == docs
    gz = root / "more.jsonl.gz"
    import gzip

    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "ünïcödé 🙂\n\ttabs"}) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")
    assert list(data_corpus.iter_documents([gz])) == ["ünïcödé 🙂\n\ttabs"]  # empty "text" skipped


def test_long_documents_become_sequences_with_one_eod(tmp_path, prepared):
    _, prep = prepared
    rng = random.Random(1)
    long_doc = _doc(rng, 400)
    assert len(long_doc) > 4 * data_corpus.SEQUENCE_CHARS
    pieces = data_corpus.split_into_sequences(long_doc)
    assert "".join(pieces) == long_doc and len(pieces) > 4
    assert all(p.endswith("\n") for p in pieces)
    assert all(len(p) <= data_corpus.SEQUENCE_CHARS for p in pieces)
    # a longer line is cut too (bounded memory, and the tokenizer trainer skips longer
    # sentences): after its last space, else anywhere
    assert data_corpus.split_into_sequences("x" * 5000) == ["x" * 2048, "x" * 2048, "x" * 904]
    line = "word " * 1000
    assert data_corpus.split_into_sequences(line) == ["word " * 409, "word " * 409, "word " * 182]

    (tmp_path / "long.txt").write_text(long_doc)
    cfg = DataConfig(paths=[str(tmp_path / "long.txt")], tokenizer_model=prep.tokenizer_path,
                     cache_dir=str(tmp_path / "cache"))
    p = prepare_data(cfg)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(p.prefix)
    assert (p.num_documents, len(ds), p.num_sequences) == (1, len(pieces), len(pieces))
    tok = p.tokenizer()
    seqs = [ds[i].tolist() for i in range(len(ds))]
    assert [s[-1] == tok.eod_id for s in seqs] == [False] * (len(seqs) - 1) + [True]
    assert tok.decode([t for s in seqs for t in s][:-1]) == long_doc


def test_sentencepiece_is_lossless(prepared):
    tok = prepared[1].tokenizer()
    for text in ["    indented\n\tTab\n\n\nblank lines  ", "  leading", "trailing \n ",
                 "ünïcödé 中文 🙂 \u00a0nbsp", "x = {'a': [1, 2]}  # comment\r\n", ""]:
        assert tok.decode(tok.encode(text)) == text


# ---------------------------------------------------------------------------------------------
# Default corpus
# ---------------------------------------------------------------------------------------------


def test_default_corpus_exists_is_bounded_and_deterministic():
    files = data_corpus.default_corpus_files(300_000)
    assert files == data_corpus.default_corpus_files(300_000)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    sizes = [f.stat().st_size for f in files]
    assert 300_000 <= sum(sizes) < 300_000 + max(sizes)
    full = data_corpus.default_corpus_files()
    assert full[:len(files)] == files  # a prefix of the sorted list
    assert data_config.DEFAULT_CORPUS_BYTES <= sum(f.stat().st_size for f in full) < 5_000_000
    assert not any(part in ("test", "tests", "site-packages") for f in full for part in f.parts)


def test_default_corpus_continues_into_site_packages():
    import sysconfig

    std = data_corpus._source_files(Path(sysconfig.get_paths()["stdlib"]), data_corpus._STDLIB_SKIP_DIRS)
    std_bytes = sum(f.stat().st_size for f in std)
    big = data_corpus.default_corpus_files(std_bytes + 500_000)
    assert big[:len(std)] == std  # the whole stdlib first, in the same order
    extra = big[len(std):]
    assert extra and all("site-packages" in f.parts for f in extra)
    assert not any(part in ("test", "tests") for f in extra for part in f.relative_to(
        sysconfig.get_paths()["purelib"]).parts)
    assert sum(f.stat().st_size for f in big) >= std_bytes + 500_000


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "big", True])
def test_default_corpus_mb_invalid(bad):
    with pytest.raises(ValueError, match=r"data\.default_corpus_mb=.*positive number of megabytes"):
        DataConfig(default_corpus_mb=bad)


def test_default_corpus_tokenizes_and_fills_the_default_split(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path))  # paths: [] -> stdlib sources, split 969,30,1
    p = prepare_data(cfg)
    files = data_corpus.default_corpus_files()
    assert p.num_documents == len(files) and p.vocab_size == 8000
    assert p.num_tokens > 500_000
    tok = p.tokenizer()
    text = files[0].read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text)) == text
    train, valid, test = build_datasets(cfg, p, seq_length=64, seed=1, num_samples=(64, 16, 4),
                                        model_vocab_size=8192)
    assert len(train) >= 64 and len(valid) >= 16 and len(test) >= 4
    assert train[0]["tokens"].max() < 8000


# ---------------------------------------------------------------------------------------------
# Splits and caches
# ---------------------------------------------------------------------------------------------


def test_splits_are_disjoint_and_sized(prepared, corpus):
    cfg, prep = prepared
    cfg = DataConfig(paths=cfg.paths, tokenizer_vocab_size=400, cache_dir=cfg.cache_dir,
                     split="6,2,2")
    train, valid, test = build_datasets(cfg, prep, seq_length=8, seed=3,
                                        num_samples=(500, 40, 7), model_vocab_size=400)
    n = prep.num_sequences
    assert (len(train) >= 500, len(valid) >= 40, len(test) >= 7) == (True, True, True)
    idx = [set(ds.indices.tolist()) for ds in (train, valid, test)]
    assert [len(s) for s in idx] == [round(0.6 * n), round(0.8 * n) - round(0.6 * n),
                                     n - round(0.8 * n)]
    assert not (idx[0] & idx[1] or idx[0] & idx[2] or idx[1] & idx[2])
    assert set.union(*idx) == set(range(n))
    # tokens per epoch of each split: its documents' tokens (sequence i is document i here)
    expected = _seq_tokens(prep.tokenizer(), corpus[1])
    assert [split_tokens(ds) for ds in (train, valid, test)] == [
        sum(len(expected[i]) for i in own) for own in idx]
    assert split_tokens(None) is None
    for ds, own in zip((train, valid, test), idx):
        assert set(np.asarray(ds.document_index).tolist()) <= own  # samples use own sequences
    # the same request loads the cached indices: identical samples
    again = build_datasets(cfg, prep, seq_length=8, seed=3, num_samples=(500, 40, 7),
                           model_vocab_size=400)[0]
    assert all(again[i]["tokens"].tolist() == train[i]["tokens"].tolist() for i in range(20))
    other = build_datasets(cfg, prep, seq_length=8, seed=4, num_samples=(500, 40, 7),
                           model_vocab_size=400)[0]  # another seed shuffles differently
    assert not np.array_equal(np.asarray(other.shuffle_index), np.asarray(train.shuffle_index))


def test_truncated_index_cache_is_rebuilt(prepared, tmp_path):
    cfg, prep = prepared
    cfg = DataConfig(paths=cfg.paths, tokenizer_vocab_size=400, cache_dir=str(tmp_path),
                     split="6,2,2")
    kwargs = dict(seq_length=8, seed=5, num_samples=(100, 10, 2), model_vocab_size=400)
    first = build_datasets(cfg, prep, **kwargs)[0]
    ref = [first[i]["tokens"].tolist() for i in range(10)]
    shuffle = sorted((tmp_path / "gpt_indices").glob("*train-shuffle_index.npy"))
    assert len(shuffle) == 1
    blob = shuffle[0].read_bytes()
    shuffle[0].write_bytes(blob[: len(blob) // 2])  # as if the writer crashed
    again = build_datasets(cfg, prep, **kwargs)[0]
    assert [again[i]["tokens"].tolist() for i in range(10)] == ref


def test_cache_is_reused_and_rebuilt_on_change(tmp_path):
    src = tmp_path / "a.txt"
    rng = random.Random(2)
    src.write_text(_doc(rng, 60))
    cfg = DataConfig(paths=[str(src)], tokenizer_vocab_size=320, cache_dir=str(tmp_path / "c"))
    p1 = prepare_data(cfg)
    bin_stat = os.stat(p1.prefix + ".bin")
    p2 = prepare_data(cfg)
    assert p2 == p1 and os.stat(p1.prefix + ".bin").st_mtime_ns == bin_stat.st_mtime_ns
    # deterministic: another cache directory trains the identical tokenizer
    p_other = prepare_data(DataConfig(paths=[str(src)], tokenizer_vocab_size=320,
                                      cache_dir=str(tmp_path / "c2")))
    assert Path(p_other.tokenizer_path).read_bytes() == Path(p1.tokenizer_path).read_bytes()
    # a changed input builds a new prepared directory
    src.write_text(src.read_text() + "One more line for the expert router.\n")
    p3 = prepare_data(cfg)
    assert p3.prefix != p1.prefix and p3.num_tokens > p1.num_tokens
    # so does a changed setting
    p4 = prepare_data(DataConfig(paths=[str(src)], tokenizer_vocab_size=340,
                                 cache_dir=str(tmp_path / "c")))
    assert p4.prefix != p3.prefix and p4.vocab_size == 340
    entries = sorted(x.name for x in (tmp_path / "c").iterdir())
    assert len(entries) == 3 and not any(e.startswith(".tmp") for e in entries)


def test_crash_mid_build_leaves_no_loadable_cache(tmp_path, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text(_doc(random.Random(3), 40))
    cfg = DataConfig(paths=[str(src)], tokenizer_vocab_size=320, cache_dir=str(tmp_path / "c"))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(preparation, "_write_json_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    assert list((tmp_path / "c").iterdir()) == []  # the temporary directory is gone
    monkeypatch.undo()
    # a stray, incomplete directory under the final name is not trusted either
    key_dir = tmp_path / "c" / f"corpus-{preparation._cache_key(cfg, [src])}"
    key_dir.mkdir()
    (key_dir / "data.bin").write_bytes(b"half")
    p = prepare_data(cfg)
    assert Path(p.prefix).parent == key_dir and p.num_documents == 1
    assert os.path.getsize(p.prefix + ".bin") > 4


_RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from megatron_moe.training import data as D
from megatron_moe.training.data import preparation
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank != 0:  # only rank 0 may build; the others must find its cache after the barrier
    def refuse(*args, **kwargs):
        raise AssertionError("rank %d built the data" % rank)
    preparation._build = refuse
cfg = D.DataConfig(paths=[sys.argv[1]], tokenizer_vocab_size=320, cache_dir=sys.argv[2],
                   split="6,2,2")
p = D.prepare_data(cfg, rank=rank)
train = D.build_datasets(cfg, p, seq_length=8, seed=1, num_samples=(40, 8, 4),
                         model_vocab_size=320)[0]
json.dump({"prefix": p.prefix, "sample": train[3]["tokens"].tolist()},
          open(os.path.join(sys.argv[2], "rank%d.json" % rank), "w"))
dist.destroy_process_group()
"""


def test_two_ranks_share_one_build(corpus, tmp_path):
    import socket
    import subprocess
    import sys

    root, _ = corpus
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(root / "txt"), str(tmp_path)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        out = proc.communicate(timeout=240)[0].decode()
        assert proc.returncode == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1
    assert len([d for d in tmp_path.iterdir() if d.name.startswith("corpus-")]) == 1


# ---------------------------------------------------------------------------------------------
# data_prefix, export, CLI
# ---------------------------------------------------------------------------------------------


def test_export_and_data_prefix(prepared, tmp_path):
    cfg, prep = prepared
    exported = preparation.export_prefix(prep, tmp_path / "out" / "corpus")
    for ext in (".bin", ".idx", ".model", ".json"):
        assert (tmp_path / "out" / f"corpus{ext}").is_file()
    # the folder can move: the sidecar stores relative paths
    shutil.move(str(tmp_path / "out"), str(tmp_path / "moved"))
    loaded = prepare_data(DataConfig(data_prefix=str(tmp_path / "moved" / "corpus"),
                                     cache_dir=str(tmp_path / "c")))
    assert (loaded.vocab_size, loaded.eod_id, loaded.num_tokens, loaded.num_documents) == (
        prep.vocab_size, prep.eod_id, prep.num_tokens, prep.num_documents)
    assert exported.num_tokens == prep.num_tokens
    assert Path(loaded.tokenizer_path).read_bytes() == Path(prep.tokenizer_path).read_bytes()
    # a megatron prefix without sidecar works when the tokenizer is named
    bare = tmp_path / "bare"
    for ext in (".bin", ".idx"):
        shutil.copyfile(prep.prefix + ext, f"{bare}{ext}")
    with pytest.raises(ValueError, match="data.data_prefix.*tokenizer"):
        prepare_data(DataConfig(data_prefix=str(bare)))
    named = prepare_data(DataConfig(data_prefix=str(bare), tokenizer_model=prep.tokenizer_path))
    assert named.num_tokens == prep.num_tokens and named.vocab_size == 400
    bare_cfg = DataConfig(data_prefix=str(bare), tokenizer_model=prep.tokenizer_path,
                          cache_dir=str(tmp_path / "c"), split="6,2,2")
    train = build_datasets(bare_cfg, named, seq_length=8, seed=1, num_samples=(10, 2, 1),
                           model_vocab_size=400)[0]
    assert len(train) >= 10


def test_cli_prepares_and_summarises(corpus, tmp_path, capsys):
    from megatron_moe.training.data.prepare_cli import main

    root, _ = corpus
    rc = main(["--input", str(root / "txt"), "--vocab-size", "320", "--cache-dir",
               str(tmp_path / "c"), "--output-prefix", str(tmp_path / "o" / "txt")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "documents  10 " in out and "vocab      320 " in out and "tokens " in out
    meta = json.loads((tmp_path / "o" / "txt.json").read_text())
    assert meta["vocab_size"] == 320 and meta["num_documents"] == 10
    rc = main(["--input", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "missing.txt does not exist" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# ---------------------------------------------------------------------------------------------


def _gpt2_byte_symbols():
    """GPT-2's byte -> printable character table, re-derived here from its definition."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    byte_sym = _gpt2_byte_symbols()
    assert byte_sym[ord(" ")] == "Ġ" and byte_sym[ord("\n")] == "Ċ"
    vocab = {byte_sym[b]: b for b in range(256)}  # byte b has id b
    merges = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt he", "Ġ w", "o r"]
    for i, m in enumerate(merges):
        vocab[m.replace(" ", "")] = 256 + i  # he=256 ll=257 hell=258 hello=259 Ġt=260
    vocab["<|endoftext|>"] = 264  # Ġthe=261 Ġw=262 or=263
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return root / "vocab.json", root / "merges.txt"


def test_gpt2_bpe_tiny_vocab_encodes_as_expected(gpt2_files):
    tok = tokenizers.GPT2BPETokenizer(*gpt2_files)
    assert (tok.vocab_size, tok.eod_id) == (265, 264)
    # "hello" -> he, ll, hell, hello; " the" -> he then Ġt then Ġthe; " world" -> Ġw, or, l, d;
    # "'s" is a contraction; " 42" has no merges
    text = "hello the world's 42"
    ids = tok.encode(text)
    assert ids == [259, 261, 262, 263, ord("l"), ord("d"), ord("'"), ord("s"), ord(" "),
                   ord("4"), ord("2")]
    assert tok.decode(ids) == text
    for s in ["", "ünï 🙂\n\n  x", "hellohello\tthe"]:  # every byte has an id: lossless
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("hellohello") == [259, 259]


def test_gpt2_pretokenizer_matches_gpt2_pattern():
    cases = {
        "Hello world's 2024!!": ["Hello", " world", "'s", " 2024", "!!"],
        "  two  spaces\n\nnext": [" ", " two", " ", " spaces", "\n", "\n", "next"],
        "a \n\n b": ["a", " \n\n", " b"],
        "end   ": ["end", "   "],
        "a\n b": ["a", "\n", " b"],
        "x 'll ?'s 'S": ["x", " '", "ll", " ?'", "s", " '", "S"],
        "é中 ٣² 🙂🙂": ["é中", " ٣²", " 🙂🙂"],
    }
    for text, pieces in cases.items():
        assert tokenizers.gpt2_pretokenize(text) == pieces, text
    regex = pytest.importorskip("regex")
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                        r"""|\s+(?!\S)|\s+""")
    alphabet = list("ab Z09 \n\t'sdtlmrve.,!?-_\"()\r") + [
        "é", "中", "٣", "²", "Ⅻ", "\x1c", "\xa0", "\u2028", "\u3000", "🙂", "\x85", "\u200b",
        "  ", "'s", "'ll", "'S"]
    rng = random.Random(0)
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert tokenizers.gpt2_pretokenize(s) == pat.findall(s), repr(s)


def test_gpt2_bpe_matches_huggingface_tokenizers(gpt2_files):
    """An independent implementation (HF `tokenizers`, where installed) agrees on every id."""
    hf = pytest.importorskip("tokenizers")
    vocab, merges = gpt2_files
    ref = hf.Tokenizer(hf.models.BPE.from_file(str(vocab), str(merges)))
    ref.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = tokenizers.GPT2BPETokenizer(vocab, merges)
    alphabet = list("helo twrd's42\n\t.!") + ["the ", "hello", " world", "ü", "🙂", "  "]
    rng = random.Random(1)
    for _ in range(500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        assert tok.encode(s) == ref.encode(s).ids, repr(s)


def test_gpt2_prepare_and_dataset(gpt2_files, corpus, tmp_path):
    root, docs = corpus
    vocab, merges = gpt2_files
    cfg = DataConfig(paths=[str(root / "txt")], tokenizer_type="gpt2bpe", vocab_file=str(vocab),
                     merges_file=str(merges), cache_dir=str(tmp_path), split="1,1,0")
    p = prepare_data(cfg, workers=2)
    tok = p.tokenizer()
    assert (p.vocab_size, p.eod_id, p.tokenizer_type) == (265, 264, "gpt2bpe")
    assert p.num_tokens == sum(len(tok.encode(d)) + 1 for d in docs[30:])
    train, valid, test = build_datasets(cfg, p, seq_length=32, seed=0, num_samples=(20, 5, 0),
                                        model_vocab_size=265)
    assert test is None and len(train) >= 20 and len(valid) >= 5
    assert tok.decode(train[0]["tokens"].tolist())  # decodes


# ---------------------------------------------------------------------------------------------
# Errors: one clear line naming the field or path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokenizer_type="bpe"), r"data\.tokenizer_type='bpe'.*sentencepiece, gpt2bpe"),
    (dict(tokenizer_type="gpt2bpe"), r"data\.vocab_file=None.*vocab\.json"),
    (dict(vocab_file="v.json"), r"data\.vocab_file.*only used with tokenizer_type: gpt2bpe"),
    (dict(tokenizer_vocab_size=100), r"data\.tokenizer_vocab_size=100.*>= 260"),
    (dict(split="90,10,0,5"), r"data\.split='90,10,0,5'.*train,valid,test"),
    (dict(split="0,1,1"), r"data\.split='0,1,1'"),
    (dict(paths=["a.txt"], data_prefix="x"), r"data\.data_prefix='x'.*exclude each other"),
    (dict(data_prefix="x.bin"), r"data\.data_prefix='x\.bin'.*without \.bin"),
    (dict(paths=[3]), r"data\.paths=\[3\]"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_config_defaults_match_the_schema():
    cfg = DataConfig()
    assert (cfg.paths, cfg.data_prefix, cfg.tokenizer_type, cfg.tokenizer_vocab_size,
            cfg.split, cfg.cache_dir) == ([], None, "sentencepiece", 8000, "969,30,1",
                                          "data_cache")
    assert DataConfig(paths="one.txt").paths == ["one.txt"]


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.paths: .*nope\.txt does not exist"):
        prepare_data(DataConfig(paths=[str(tmp_path / "nope.txt")], cache_dir=str(tmp_path)))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data\.paths: directory .*empty_dir has no"):
        prepare_data(DataConfig(paths=[str(tmp_path / "empty_dir")], cache_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer_model: .*none\.model does not"):
        prepare_data(DataConfig(tokenizer_model=str(tmp_path / "none.model")))
    with pytest.raises(FileNotFoundError, match=r"data\.merges_file: .*m\.txt does not exist"):
        (tmp_path / "v.json").write_text("{}")
        prepare_data(DataConfig(tokenizer_type="gpt2bpe", vocab_file=str(tmp_path / "v.json"),
                                merges_file=str(tmp_path / "m.txt")))


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n\n')
    with pytest.raises(ValueError, match=r"data\.paths: no text in the 2 input file"):
        prepare_data(DataConfig(paths=[str(tmp_path / "empty.txt"), str(tmp_path / "blank.jsonl")],
                                cache_dir=str(tmp_path / "c")))
    assert not any((tmp_path / "c").iterdir())


def test_jsonl_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:2: JSONL line has no "text" field'):
        list(data_corpus.iter_documents([bad]))
    bad.write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:2: "text" is a int'):
        list(data_corpus.iter_documents([bad]))
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        prepare_data(DataConfig(paths=[str(bad)], cache_dir=str(tmp_path / "c")))


def test_vocab_mismatch_and_bad_prefixes(prepared, gpt2_files, tmp_path):
    cfg, prep = prepared
    with pytest.raises(ValueError, match=r"model\.vocab_size=256 is smaller than the "
                                         r"tokenizer's vocabulary \(400 tokens"):
        build_datasets(cfg, prep, seq_length=8, seed=0, num_samples=(1, 1, 1),
                       model_vocab_size=256)
    half = tmp_path / "half"
    shutil.copyfile(prep.prefix + ".bin", f"{half}.bin")
    with pytest.raises(FileNotFoundError, match=r"data\.data_prefix: .*half\.idx does not exist"):
        prepare_data(DataConfig(data_prefix=str(half), tokenizer_model=prep.tokenizer_path))
    os.remove(f"{half}.bin")
    shutil.copyfile(prep.prefix + ".idx", f"{half}.idx")
    with pytest.raises(FileNotFoundError, match=r"data\.data_prefix: .*half\.bin does not exist"):
        prepare_data(DataConfig(data_prefix=str(half), tokenizer_model=prep.tokenizer_path))
    # data made by the 400-piece sentencepiece model, read with the 265-token GPT-2 vocabulary
    vocab, merges = gpt2_files
    with pytest.raises(ValueError, match=r"data\.data_prefix: .* holds token id \d+ but the "
                                         r"tokenizer .* has only 265"):
        prepare_data(DataConfig(data_prefix=prep.prefix, tokenizer_type="gpt2bpe",
                                vocab_file=str(vocab), merges_file=str(merges)))


def test_tokenizer_errors(tmp_path, gpt2_files):
    src = tmp_path / "small.txt"
    src.write_text("tiny corpus\n")
    with pytest.raises(ValueError, match=r"data\.tokenizer_vocab_size=5000 cannot be trained: "
                                         r"at most \d+ pieces fit this corpus"):
        prepare_data(DataConfig(paths=[str(src)], tokenizer_vocab_size=5000,
                                cache_dir=str(tmp_path / "c")))
    vocab, merges = gpt2_files
    no_eod = tmp_path / "vocab.json"
    v = json.loads(Path(vocab).read_text())
    del v["<|endoftext|>"]
    no_eod.write_text(json.dumps(v))
    with pytest.raises(ValueError, match=r"data\.vocab_file: .* has no '<\|endoftext\|>'"):
        tokenizers.GPT2BPETokenizer(no_eod, merges)
    not_a_model = tmp_path / "x.model"
    not_a_model.write_text("junk")
    with pytest.raises(ValueError, match=r"data\.tokenizer_model: .*x\.model is not a "
                                         r"sentencepiece"):
        prepare_data(DataConfig(paths=[str(src)], tokenizer_model=str(not_a_model),
                                cache_dir=str(tmp_path / "c")))


def test_split_without_sequences(tmp_path, prepared):
    _, prep = prepared
    src = tmp_path / "one.txt"
    src.write_text("a single short document\n")
    cfg = DataConfig(paths=[str(src)], tokenizer_model=prep.tokenizer_path,
                     cache_dir=str(tmp_path / "c"))  # split 969,30,1 over 1 sequence
    p = prepare_data(cfg)
    with pytest.raises(ValueError, match=r"data\.split='969,30,1' leaves the valid split "
                                         r"without sequences: .* has only 1"):
        build_datasets(cfg, p, seq_length=4, seed=0, num_samples=(4, 1, 1), model_vocab_size=400)
