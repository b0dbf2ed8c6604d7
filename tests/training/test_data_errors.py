"""What a user sees when the data is wrong: one ValueError naming the file, the line and the fix,
whichever stage of preparation meets the problem first, and no megatron-core notices.

    python -m pytest -q tests/training/test_data_errors.py

Stages: training the sentencepiece tokenizer (its trainer pulls the documents through a
callback and used to report any error there as a vocabulary-size problem), encoding with a
given or trained tokenizer (also for a line past the trainer's sample), and reading the files.
The expected file names and line numbers are those the tests write.
"""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_moe.training.data import DataConfig, prepare_data, preparation
from megatron_moe.training.data.prepare_cli import main

REPO = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def _line(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12)) + f" {i}.\n"


def _jsonl(path: Path, n_good: int, bad: str | None = None, after: int = 0) -> Path:
    """``n_good`` good lines, then ``bad`` (a raw line) at line n_good + 1, then ``after`` more."""
    with open(path, "w") as f:
        for i in range(n_good):
            f.write(json.dumps({"text": _line(i)}) + "\n")
        if bad is not None:
            f.write(bad + "\n")
        for i in range(after):
            f.write(json.dumps({"text": _line(n_good + i)}) + "\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 300-piece sentencepiece model trained on good lines."""
    root = tmp_path_factory.mktemp("model")
    cfg = DataConfig(paths=[str(_jsonl(root / "good.jsonl", 200))], tokenizer_vocab_size=300,
                     cache_dir=str(root / "cache"))
    return prepare_data(cfg).tokenizer_path


def _error(tmp_path: Path, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        prepare_data(DataConfig(cache_dir=str(tmp_path / "cache"), **kwargs))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("bad, what", [
    ('{"content": "no text key"}', 'JSONL line has no "text" field'),
    ('{"text": null}', '"text" is a NoneType, not a string'),
    ("not json", "not valid JSON"),
])
def test_bad_line_met_while_training_the_tokenizer(tmp_path, bad, what):
    path = _jsonl(tmp_path / "bad.jsonl", 50, bad, after=5)
    msg = _error(tmp_path, paths=[str(path)], tokenizer_vocab_size=300)
    assert msg.startswith(f"{path}:51: {what}"), msg
    assert 'must be {"text"' in msg  # the fix
    assert "tokenizer_vocab_size" not in msg  # not a vocabulary-size problem
    assert not any((tmp_path / "cache").iterdir())  # nothing half-built left


def test_bad_line_met_while_encoding(tmp_path, model, monkeypatch):
    path = _jsonl(tmp_path / "bad.jsonl", 50, '{"content": 1}', after=5)
    # a given tokenizer: only encoding reads the corpus
    msg = _error(tmp_path, paths=[str(path)], tokenizer_model=model)
    assert msg.startswith(f'{path}:51: JSONL line has no "text" field'), msg
    # a trained one whose sample ends before line 51: encoding meets it
    monkeypatch.setattr(preparation, "TOKENIZER_TRAIN_CHARS", 2000)
    msg = _error(tmp_path, paths=[str(path)], tokenizer_vocab_size=300)
    assert msg.startswith(f'{path}:51: JSONL line has no "text" field'), msg


def test_cli_names_the_line(tmp_path, capsys):
    path = _jsonl(tmp_path / "bad.jsonl", 50, '{"body": "x"}')
    rc = main(["--input", str(path), "--vocab-size", "300", "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith(f'megatron-moe-prepare-data: error: {path}:51: JSONL line has no "text"')


def test_lone_surrogate_becomes_replacement_character(tmp_path, model):
    """json.loads turns "\\ud83d" without its pair into a lone surrogate, which no tokenizer
    can encode (sentencepiece: "Unable to cast Python instance"): it becomes U+FFFD, as
    undecodable bytes do when files are read."""
    bad = '{"text": "broken \\ud83d emoji"}'
    assert json.loads(bad)["text"] == "broken \ud83d emoji"
    path = _jsonl(tmp_path / "s.jsonl", 50, bad)
    for kwargs in ({"tokenizer_vocab_size": 300}, {"tokenizer_model": model}):
        p = prepare_data(DataConfig(paths=[str(path)], cache_dir=str(tmp_path / "c"), **kwargs))
        assert p.num_documents == 51
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(p.prefix)  # kept: its items are views of its memory map
        assert p.tokenizer().decode(ds[len(ds) - 1].tolist()[:-1]) == "broken \ufffd emoji"


def test_corpus_of_long_lines_trains(tmp_path):
    """Documents without newlines, longer than a stored sequence: cut into pieces the
    tokenizer trainer accepts (it skips sentences over its length limit, and with every one
    skipped used to fail with "sentences_.empty()" reported as a vocabulary-size problem)."""
    docs = ["".join(_line(i).rstrip("\n") + " " for i in range(k, k + 200)) for k in range(20)]
    assert all(len(d) > 4 * 2048 and "\n" not in d for d in docs)
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    p = prepare_data(DataConfig(paths=[str(path)], tokenizer_vocab_size=300,
                                cache_dir=str(tmp_path / "c")))
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds, tok = IndexedDataset(p.prefix), p.tokenizer()
    assert p.num_documents == len(docs) and p.num_sequences > 4 * len(docs)
    text = tok.decode([t for i in range(len(ds)) for t in ds[i].tolist() if t != tok.eod_id])
    assert text == "".join(docs)


def test_tokenizer_that_cannot_encode_a_line(tmp_path):
    """A GPT-2 vocabulary without the space symbol "Ġ": the error names the data line where the
    tokenizer fails, with or without worker processes, besides the vocabulary."""
    vocab = {chr(b): i for i, b in enumerate(range(33, 127))}  # printable bytes map to themselves
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also-fine"}\n{"text": "has a space"}\n')
    for workers in (None, 2):
        with pytest.raises(ValueError) as e:
            prepare_data(DataConfig(paths=[str(path)], tokenizer_type="gpt2bpe",
                                    vocab_file=str(tmp_path / "vocab.json"),
                                    merges_file=str(tmp_path / "merges.txt"),
                                    cache_dir=str(tmp_path / "c")), workers=workers)
        assert str(e.value).startswith(f"{path}:3: the tokenizer cannot encode"), str(e.value)
        assert "has no id for the BPE symbol 'Ġ'" in str(e.value)


def test_truncated_gzip(tmp_path, model):
    path = tmp_path / "part.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(2000):
            f.write(json.dumps({"text": _line(i)}) + "\n")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    msg = _error(tmp_path, paths=[str(path)], tokenizer_model=model)
    assert msg.startswith(f"{path}: cannot be read (EOFError") and "truncated or corrupt" in msg


def test_prepare_data_prints_no_megatron_notices(tmp_path, model):
    """megatron-core warns at import that Transformer Engine and Apex are missing; the
    trainer hides those notices (megatron_moe.megatron), and so must megatron-moe-prepare-data,
    run as users run it: a fresh interpreter with default warning filters."""
    path = _jsonl(tmp_path / "good.jsonl", 20)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for args in (["--tokenizer-model", model], ["--vocab-size", "300"]):
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_moe.training.data.prepare_cli", "--input", str(path),
             "--cache-dir", str(tmp_path / "c"), *args],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stderr == "", proc.stderr[-2000:]
        assert "tokens" in proc.stdout
