"""Training data: text / JSONL -> tokenizer -> megatron-core .bin/.idx -> GPTDataset splits.

    from megatron_moe.data import DataConfig, prepare_data, build_datasets
    cfg = DataConfig()                            # default corpus: Python stdlib sources
    prepared = prepare_data(cfg)                  # cached under cfg.cache_dir, keyed by inputs
    train, valid, test = build_datasets(cfg, prepared, seq_length=256, seed=1234,
                                        num_samples=(4096, 512, 64), model_vocab_size=8192)
    train[0]  # {"tokens", "labels", "loss_mask", "position_ids"}: tensors of length 256

The same pipeline from the shell (see ``megatron_moe/data_prep.py`` for more commands):

    megatron-moe-prepare-data                                      # the default corpus
    megatron-moe-prepare-data --input pile/00.jsonl --output-prefix data/pile

Pipeline:

1. Documents. ``data.paths`` lists files or directories (searched recursively, sorted).
   ``*.jsonl`` (also ``.jsonl.gz``; ``.jsonl.zst`` with the ``zstandard`` package) holds
   one ``{"text": ...}`` per line, The Pile's format; every other file is one plain-text
   document (UTF-8). In directories only ``.txt .text .md .rst .py .jsonl`` (also as
   ``.gz``/``.zst``) are read. Empty ``paths`` = the default corpus: a bounded, deterministic subset
   of the Python standard library's ``.py`` sources (found through ``sysconfig``; about
   4 MB, no download). Each document is stored as sequences of about 2048 characters cut at
   line ends (megatron-core splits train/valid/test by sequence, so small corpora still
   fill every split) and the EOD token follows each document's last sequence.
2. Tokenizer. ``tokenizer_type: sentencepiece`` trains a BPE model (byte fallback, identity
   normalisation, whitespace kept: ``decode(encode(text)) == text``; at most 10 M characters
   of training text, so it takes seconds) with ``tokenizer_vocab_size`` pieces, or loads
   ``tokenizer_model``. ``tokenizer_type: gpt2bpe`` reads a GPT-2 ``vocab.json`` +
   ``merges.txt`` (byte-level BPE, implemented here in plain Python; EOD ``<|endoftext|>``).
3. megatron-core's ``IndexedDatasetBuilder`` writes ``data.bin``/``data.idx`` into
   ``cache_dir/<name>-<hash>/``. The hash covers the input files (path, size, mtime), the
   tokenizer settings and file contents, and this module's format version: a second run
   reuses the directory, a changed input builds a new one. A build happens in a temporary
   directory renamed into place when complete, so a crash never leaves a cache that loads.
   ``data_prefix`` skips all this and uses an existing ``.bin``/``.idx`` pair.
4. ``build_datasets`` wraps the prefix in megatron-core's ``GPTDataset`` (via
   ``BlendedMegatronDatasetBuilder``) with ``split`` (e.g. ``"969,30,1"``); their index
   caches go to ``cache_dir/gpt_indices``. megatron-core's compiled helpers
   (``helpers_cpp``) ship inside its binary wheels (cp311 and cp312 alike); nothing is
   compiled at run time.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import math
import os
import re
import shutil
import struct
import sysconfig
import unicodedata
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

FORMAT_VERSION = 1
"""Bump when the prepared layout or the tokenization changes: old caches are then ignored."""
DEFAULT_CORPUS_BYTES = 4_000_000
"""Size of the default corpus (Python stdlib sources, whole files in sorted order); the
``data.default_corpus_mb`` of a run config overrides it."""
SEQUENCE_CHARS = 2048
"""Documents are stored as sequences of about this many characters (cut after a newline)."""
TOKENIZER_TRAIN_CHARS = 10_000_000
"""At most this much text (the corpus' first sequences) trains a sentencepiece model."""
TOKENIZER_TYPES = ("sentencepiece", "gpt2bpe")
MIN_SENTENCEPIECE_VOCAB = 260
"""256 byte-fallback pieces + unk, bos, eos + at least one more."""
DIR_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".jsonl")
"""Files read from a directory (also as ``.gz``/``.zst``); a named file is always read."""
_STDLIB_SKIP_DIRS = {
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "turtledemo",
    "lib2to3", "ensurepip", "encodings", "pydoc_data",
}
_STDLIB_MAX_FILE_BYTES = 256_000
_EOD_GPT2 = "<|endoftext|>"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """The ``data:`` section of a run config. Invalid values raise ``ValueError('data.x ...')``."""

    paths: list[str] = field(default_factory=list)
    """Text / .jsonl files or directories; empty = the default corpus (Python stdlib sources)."""
    default_corpus_mb: float = DEFAULT_CORPUS_BYTES / 1e6
    """Size of the default corpus in MB of source text (~3.8 bytes per token with the default
    8000-piece tokenizer): the stdlib's sources first, then the installed packages' (site-packages)
    when more is asked for than the stdlib has (~9 MB). A run that trains on more tokens than
    this holds repeats it, and its validation loss then measures memorisation: keep it above
    the tokens trained (the reproduction's configs ask for 200 MB, ~50M tokens)."""
    data_prefix: str | None = None
    """An existing megatron .bin/.idx prefix (skips preparation; exclusive with ``paths``)."""
    tokenizer_type: str = "sentencepiece"
    """'sentencepiece' (trained, or ``tokenizer_model``) or 'gpt2bpe' (vocab + merges files)."""
    tokenizer_model: str | None = None
    """An existing sentencepiece .model; None = train one on the corpus."""
    vocab_file: str | None = None
    """gpt2bpe: the vocab.json."""
    merges_file: str | None = None
    """gpt2bpe: the merges.txt."""
    tokenizer_vocab_size: int = 8000
    """Pieces of a trained sentencepiece model (ignored when a tokenizer is given)."""
    split: str = "969,30,1"
    """train,valid,test weights; megatron-core splits the corpus' sequences in this ratio."""
    cache_dir: str = "data_cache"
    """Prepared data and GPTDataset index caches."""

    def __post_init__(self) -> None:
        validate_data_config(self)


def _fail(name: str, value, valid: str) -> None:
    raise ValueError(f"data.{name}={value!r} is invalid: {valid}")


def _optional_path(cfg: DataConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
        _fail(name, value, "a file path or null")
    if value is not None:
        setattr(cfg, name, os.path.expanduser(str(value)))


def validate_data_config(cfg: DataConfig) -> None:
    if isinstance(cfg.paths, (str, os.PathLike)):
        cfg.paths = [str(cfg.paths)]
    if not isinstance(cfg.paths, (list, tuple)) or not all(
        isinstance(p, (str, os.PathLike)) and str(p) for p in cfg.paths
    ):
        _fail("paths", cfg.paths, "a list of file or directory paths ([] = the default corpus)")
    cfg.paths = [os.path.expanduser(str(p)) for p in cfg.paths]
    mb = cfg.default_corpus_mb
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or mb <= 0:
        _fail("default_corpus_mb", mb, "a positive number of megabytes, e.g. 4 (the default) or 200")
    for name in ("data_prefix", "tokenizer_model", "vocab_file", "merges_file"):
        _optional_path(cfg, name)
    if cfg.data_prefix is not None:
        if cfg.data_prefix.endswith((".bin", ".idx")):
            _fail("data_prefix", cfg.data_prefix, "the prefix without .bin/.idx")
        if cfg.paths:
            _fail("data_prefix", cfg.data_prefix,
                  "data.paths and data.data_prefix exclude each other (set paths: [] to use "
                  "the prefix, or data_prefix: null to prepare the paths)")
    if cfg.tokenizer_type not in TOKENIZER_TYPES:
        _fail("tokenizer_type", cfg.tokenizer_type, f"one of {', '.join(TOKENIZER_TYPES)}")
    if cfg.tokenizer_type == "gpt2bpe":
        for name in ("vocab_file", "merges_file"):
            if getattr(cfg, name) is None:
                _fail(name, None, "tokenizer_type gpt2bpe needs data.vocab_file (vocab.json) "
                                  "and data.merges_file (merges.txt)")
        if cfg.tokenizer_model is not None:
            _fail("tokenizer_model", cfg.tokenizer_model,
                  "a sentencepiece model; with tokenizer_type gpt2bpe leave it null")
    else:
        for name in ("vocab_file", "merges_file"):
            if getattr(cfg, name) is not None:
                _fail(name, getattr(cfg, name),
                      "only used with tokenizer_type: gpt2bpe (sentencepiece takes "
                      "data.tokenizer_model)")
    v = cfg.tokenizer_vocab_size
    if isinstance(v, bool) or not isinstance(v, int) or v < MIN_SENTENCEPIECE_VOCAB:
        _fail("tokenizer_vocab_size", v,
              f"an integer >= {MIN_SENTENCEPIECE_VOCAB} (256 byte pieces + specials)")
    cfg.split = _normalize_split(cfg.split)
    if not isinstance(cfg.cache_dir, (str, os.PathLike)) or not str(cfg.cache_dir):
        _fail("cache_dir", cfg.cache_dir, "a directory path")
    cfg.cache_dir = os.path.expanduser(str(cfg.cache_dir))


def _normalize_split(split) -> str:
    valid = ('up to three comma-separated non-negative weights "train,valid,test" with '
             'train > 0, e.g. "969,30,1"')
    if isinstance(split, (list, tuple)):
        split = ",".join(str(s) for s in split)
    if not isinstance(split, str) or not re.fullmatch(
        r"\s*\d+(\.\d*)?\s*(,\s*\d+(\.\d*)?\s*){0,2}", split
    ):
        _fail("split", split, valid)
    weights = [float(s) for s in split.split(",")]
    if weights[0] <= 0:
        _fail("split", split, valid)
    return ",".join(s.strip() for s in split.split(","))


def split_weights(split: str) -> list[float]:
    """``"969,30,1"`` -> [0.969, 0.03, 0.001] (missing entries are 0)."""
    w = [float(s) for s in split.split(",")]
    w += [0.0] * (3 - len(w))
    total = sum(w)
    return [x / total for x in w]


# ----------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------


def _source_files(root: Path, skip: set[str]) -> list[Path]:
    """``.py`` files under ``root`` (0 < size <= 256 KB), sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(("config-", "."))]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                size = path.stat().st_size
                if 0 < size <= _STDLIB_MAX_FILE_BYTES:
                    found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def default_corpus_files(max_bytes: int | None = None) -> list[Path]:
    """The default corpus: the stdlib's ``.py`` files in sorted order until ``max_bytes``, then
    (only if the stdlib holds less) those of the installed packages (site-packages).

    Tests, vendored packages, generated tables (encodings, pydoc_data) and files over
    256 KB are left out. Deterministic for a given Python installation.
    """
    max_bytes = DEFAULT_CORPUS_BYTES if max_bytes is None else max_bytes
    paths = sysconfig.get_paths()
    root = Path(paths["stdlib"])
    files, total = [], 0
    sources = [(root, _STDLIB_SKIP_DIRS), (Path(paths["purelib"]), _STDLIB_SKIP_DIRS - {"site-packages"})]
    for src, skip in sources:
        if total >= max_bytes or not src.is_dir():
            break
        for path in _source_files(src, skip):
            if total >= max_bytes:
                break
            files.append(path)
            total += path.stat().st_size
    if not files:
        raise FileNotFoundError(
            f"data.paths is empty and the default corpus (Python stdlib sources under {root}) "
            "has no .py files on this machine: set data.paths to your text or .jsonl files"
        )
    return files


def _base_suffix(path: Path) -> str:
    name = path.name.lower()
    for comp in (".gz", ".zst"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    return os.path.splitext(name)[1]


def resolve_inputs(paths: Sequence[str]) -> list[Path]:
    """Expand ``data.paths`` into a sorted list of files; missing paths raise FileNotFoundError."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"data.paths: {p} does not exist")
        if path.is_dir():
            inside = sorted(
                f for f in path.rglob("*")
                if f.is_file()
                and not any(part.startswith(".") for part in f.relative_to(path).parts)
                and _base_suffix(f) in DIR_SUFFIXES
            )
            if not inside:
                raise FileNotFoundError(
                    f"data.paths: directory {p} has no {'/'.join(DIR_SUFFIXES)} files "
                    "(name the files explicitly to read other extensions)"
                )
            files.extend(inside)
        else:
            files.append(path)
    return files


def _open_text(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(
                f"data.paths: {path} is zstd-compressed: pip install zstandard, or decompress "
                f"it first (zstd -d {path})"
            ) from None
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    """Yield the non-empty documents of ``files``: a JSONL line's "text", or a whole text file."""
    for path in files:
        with _open_text(path) as f:
            if _base_suffix(path) != ".jsonl":
                text = f.read()
                if text:
                    yield text
                continue
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line of a "
                                     '.jsonl file must be {"text": ...}') from None
                if not isinstance(record, dict) or "text" not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f'{path}:{lineno}: JSONL line has no "text" field (got '
                                     f'{keys}); each line must be {{"text": ...}}')
                text = record["text"]
                if not isinstance(text, str):
                    raise ValueError(f'{path}:{lineno}: "text" is a {type(text).__name__}, '
                                     "not a string")
                if text:
                    yield text


def split_into_sequences(text: str, max_chars: int = SEQUENCE_CHARS) -> list[str]:
    """Cut ``text`` after newlines into pieces of about ``max_chars`` (a longer line stays whole).

    ``"".join(split_into_sequences(t)) == t``.
    """
    if len(text) <= max_chars:
        return [text]
    pieces, start, n = [], 0, len(text)
    while start < n:
        if n - start <= max_chars:
            pieces.append(text[start:])
            break
        cut = text.rfind("\n", start, start + max_chars)
        if cut < 0:
            cut = text.find("\n", start + max_chars)
            if cut < 0:
                pieces.append(text[start:])
                break
        pieces.append(text[start:cut + 1])
        start = cut + 1
    return pieces


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


class SentencePieceTokenizer:
    """A sentencepiece model; EOD is its eos piece."""

    type = "sentencepiece"

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        self.path = str(model_path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"data.tokenizer_model: {model_path} is not a sentencepiece model "
                             f"({str(e).splitlines()[0]})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod_id = self.sp.eos_id()
        if self.eod_id < 0:
            raise ValueError(f"data.tokenizer_model: {model_path} has no eos piece to end "
                             "documents with (train it with eos_id >= 0)")

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], workers: int | None = None) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=workers or os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


def train_sentencepiece(texts: Iterable[str], vocab_size: int, model_path: str | os.PathLike,
                        *, threads: int = 2) -> None:
    """Train a lossless byte-fallback BPE model on ``texts`` (deterministic) into ``model_path``.

    Whitespace, newlines and case are kept (identity normalisation, no dummy prefix, no
    whitespace squeezing), so code tokenizes and decodes back exactly. A ``vocab_size``
    the text cannot fill raises ``ValueError`` naming ``data.tokenizer_vocab_size``.
    """
    import sentencepiece as spm

    spm.set_random_generator_seed(1234)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, character_coverage=0.9995,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            max_sentence_length=4 * SEQUENCE_CHARS + 1024, shuffle_input_sentence=False,
            input_sentence_size=0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=threads, minloglevel=2,
        )
    except RuntimeError as e:
        msg = str(e).splitlines()[0]
        most = re.search(r"value <= (\d+)", msg)
        least = re.search(r"smaller than required_chars\. \d+ vs (\d+)", msg)
        hint = (f"at most {most.group(1)} pieces fit this corpus" if most else
                f"this corpus' characters need at least {least.group(1)}" if least else msg)
        raise ValueError(f"data.tokenizer_vocab_size={vocab_size} cannot be trained: {hint}; "
                         "lower data.tokenizer_vocab_size or add text") from None
    tmp = Path(f"{model_path}.tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, model_path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Unicode White_Space (what \s means in the `regex` module GPT-2's pattern was written for).
_WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                        "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_SPACE, _LETTER, _NUMBER, _OTHER = range(4)
_CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")
_class_cache: dict[str, int] = {}


def _char_class(c: str) -> int:
    k = _class_cache.get(c)
    if k is None:
        if c in _WHITESPACE:
            k = _SPACE
        else:
            cat = unicodedata.category(c)[0]
            k = _LETTER if cat == "L" else _NUMBER if cat == "N" else _OTHER
        if len(_class_cache) < 1 << 16:
            _class_cache[c] = k
    return k


def gpt2_pretokenize(text: str) -> list[str]:
    """Split ``text`` as GPT-2's pattern does, without the ``regex`` package::

        's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    """
    cls = [_char_class(c) for c in text]
    out, i, n = [], 0, len(text)
    while i < n:
        c, k = text[i], cls[i]
        if c == "'":
            suffix = next((s for s in _CONTRACTIONS if text.startswith(s, i + 1)), None)
            if suffix is not None:
                out.append(text[i:i + 1 + len(suffix)])
                i += 1 + len(suffix)
                continue
        if k == _SPACE:
            j = i + 1
            while j < n and cls[j] == _SPACE:
                j += 1
            if c == " " and j == i + 1 and j < n:
                # ' ?X+': a single space joins the run that follows it
                k, start, i = cls[j], i, j
            elif j == n or j == i + 1:
                out.append(text[i:j])  # \s+ to the end, or one whitespace before a non-space
                i = j
                continue
            else:
                out.append(text[i:j - 1])  # \s+(?!\S): leave the last one for the next token
                i = j - 1
                continue
        else:
            start = i
        i += 1
        while i < n and cls[i] == k:
            i += 1
        out.append(text[start:i])
    return out


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; EOD is ``<|endoftext|>``."""

    type = "gpt2bpe"

    def __init__(self, vocab_file: str | os.PathLike, merges_file: str | os.PathLike):
        self.path, self.merges_path = str(vocab_file), str(merges_file)
        for name, p in (("vocab_file", vocab_file), ("merges_file", merges_file)):
            if not Path(p).is_file():
                raise FileNotFoundError(f"data.{name}: {p} does not exist")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                encoder = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"data.vocab_file: {vocab_file} is not a JSON vocabulary "
                             f"({e})") from None
        if not isinstance(encoder, dict) or not encoder or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in encoder.items()
        ):
            raise ValueError(f"data.vocab_file: {vocab_file} must map token strings to ids")
        self.encoder: dict[str, int] = encoder
        self.decoder = {v: k for k, v in encoder.items()}
        self.bpe_ranks: dict[tuple[str, str], int] = {}
        with open(merges_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip() or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2 or not all(parts):
                    raise ValueError(f"data.merges_file: {merges_file}:{lineno}: expected two "
                                     f"symbols separated by one space, got {line!r}")
                self.bpe_ranks.setdefault((parts[0], parts[1]), len(self.bpe_ranks))
        if _EOD_GPT2 not in encoder:
            raise ValueError(f"data.vocab_file: {vocab_file} has no {_EOD_GPT2!r} token "
                             "(needed to end documents)")
        self.eod_id = encoder[_EOD_GPT2]
        self.vocab_size = max(encoder.values()) + 1
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        symbols = list(word)
        ranks = self.bpe_ranks
        while len(symbols) > 1:
            pairs = [(ranks.get(p, -1), p) for p in zip(symbols, symbols[1:])]
            known = [rp for rp in pairs if rp[0] >= 0]
            if not known:
                break
            first, second = min(known)[1]
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        try:
            ids = [self.encoder[s] for s in symbols]
        except KeyError as e:
            raise ValueError(f"data.vocab_file: {self.path} has no id for the BPE symbol "
                             f"{e.args[0]!r} (vocab.json and merges.txt do not match)") from None
        if len(self._cache) > 200_000:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in gpt2_pretokenize(text):
            ids.extend(self._bpe("".join(self.byte_encoder[b] for b in piece.encode("utf-8"))))
        return ids

    def encode_batch(self, texts: list[str], workers: int | None = None) -> list[list[int]]:
        if workers and workers > 1 and len(texts) > 1:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(workers, _gpt2_worker_init,
                                              (self.path, self.merges_path)) as pool:
                chunk = max(1, len(texts) // (4 * workers))
                return pool.map(_gpt2_worker_encode, texts, chunksize=chunk)
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        chars = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in chars).decode("utf-8", errors="replace")


_worker_tokenizer: GPT2BPETokenizer | None = None


def _gpt2_worker_init(vocab_file: str, merges_file: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = GPT2BPETokenizer(vocab_file, merges_file)


def _gpt2_worker_encode(text: str) -> list[int]:
    return _worker_tokenizer.encode(text)


def load_tokenizer(tokenizer_type: str, path: str, merges_path: str | None = None):
    """A ``SentencePieceTokenizer`` or ``GPT2BPETokenizer`` (``.encode``, ``.decode``,
    ``.vocab_size``, ``.eod_id``)."""
    if tokenizer_type == "gpt2bpe":
        return GPT2BPETokenizer(path, merges_path)
    return SentencePieceTokenizer(path)


# ----------------------------------------------------------------------------------------------
# Preparation (.bin/.idx), cached
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    """A megatron .bin/.idx prefix and the tokenizer that made it."""

    prefix: str
    """Path prefix of the .bin/.idx pair."""
    tokenizer_path: str
    """The sentencepiece .model, or the GPT-2 vocab.json (merges in ``merges_path``)."""
    vocab_size: int
    """The tokenizer's vocabulary size (every token id is below it)."""
    eod_id: int
    """End-of-document token id, appended after each document."""
    num_tokens: int
    """Tokens in the .bin, EOD tokens included."""
    tokenizer_type: str = "sentencepiece"
    merges_path: str | None = None
    num_documents: int = 0
    num_sequences: int = 0

    def tokenizer(self):
        return load_tokenizer(self.tokenizer_type, self.tokenizer_path, self.merges_path)


_META = "meta.json"


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _meta_to_prepared(meta: dict, base: Path, prefix: Path) -> PreparedData:
    def rel(p):
        return None if p is None else str((base / p) if not os.path.isabs(p) else Path(p))

    return PreparedData(
        prefix=str(prefix), tokenizer_path=rel(meta["tokenizer_path"]),
        vocab_size=int(meta["vocab_size"]), eod_id=int(meta["eod_id"]),
        num_tokens=int(meta["num_tokens"]), tokenizer_type=meta["tokenizer_type"],
        merges_path=rel(meta.get("merges_path")), num_documents=int(meta.get("num_documents", 0)),
        num_sequences=int(meta.get("num_sequences", 0)),
    )


def _file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_key(cfg: DataConfig, files: list[Path]) -> str:
    key = {"format": FORMAT_VERSION, "sequence_chars": SEQUENCE_CHARS,
           "tokenizer_type": cfg.tokenizer_type, "inputs": []}
    for f in files:
        st = f.stat()
        key["inputs"].append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    if cfg.tokenizer_type == "gpt2bpe":
        key["vocab"], key["merges"] = _file_digest(cfg.vocab_file), _file_digest(cfg.merges_file)
    elif cfg.tokenizer_model is not None:
        key["model"] = _file_digest(cfg.tokenizer_model)
    else:
        key["train"] = [cfg.tokenizer_vocab_size, TOKENIZER_TRAIN_CHARS]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _check_tokenizer_files(cfg: DataConfig) -> None:
    for name in ("tokenizer_model", "vocab_file", "merges_file"):
        p = getattr(cfg, name)
        if p is not None and not Path(p).is_file():
            raise FileNotFoundError(f"data.{name}: {p} does not exist")


def _is_complete(directory: Path) -> bool:
    return all((directory / n).is_file() for n in (_META, "data.bin", "data.idx"))


def _distributed() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def prepare_data(data_cfg: DataConfig, *, rank: int = 0,
                 workers: int | None = None) -> PreparedData:
    """Tokenize the corpus into ``cache_dir`` once; later calls with the same inputs reuse it.

    Only ``rank`` 0 builds; with torch.distributed initialised the other ranks wait at a
    barrier (every rank must call this). A rank that still finds no cache afterwards
    (node-local ``cache_dir``) builds its own copy; concurrent builds are safe. ``workers``:
    encoding threads (sentencepiece) or processes (gpt2bpe); None = all cores / one process.
    """
    _check_tokenizer_files(data_cfg)
    if data_cfg.data_prefix is not None:
        return _existing_prefix(data_cfg)
    files = (resolve_inputs(data_cfg.paths) if data_cfg.paths
             else default_corpus_files(int(data_cfg.default_corpus_mb * 1e6)))
    name = "corpus" if data_cfg.paths else "stdlib"
    cache = Path(data_cfg.cache_dir)
    directory = cache / f"{name}-{_cache_key(data_cfg, files)}"
    if rank == 0 and not _is_complete(directory):
        _build(data_cfg, files, directory, workers)
    if _distributed():
        import torch

        torch.distributed.barrier()
    if not _is_complete(directory):
        _build(data_cfg, files, directory, workers)
    meta = json.loads((directory / _META).read_text())
    return _meta_to_prepared(meta, directory, directory / "data")


def _training_sample(files: list[Path]) -> Iterator[str]:
    total = 0
    for doc in iter_documents(files):
        for seq in split_into_sequences(doc):
            yield seq
            total += len(seq)
            if total >= TOKENIZER_TRAIN_CHARS:
                return


def _empty_corpus_error(cfg: DataConfig, files: list[Path]) -> ValueError:
    shown = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    return ValueError(f"data.paths: no text in the {len(files)} input file(s) ({shown}): the "
                      "corpus is empty (empty files, or JSONL lines with empty \"text\")")


def _build(cfg: DataConfig, files: list[Path], directory: Path, workers: int | None) -> None:
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".tmp-{directory.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = {"tokenizer_type": cfg.tokenizer_type, "merges_path": None,
                "format": FORMAT_VERSION, "inputs": [str(f) for f in files]}
        # A given tokenizer is loaded from the user's files (errors name them), then copied.
        if cfg.tokenizer_type == "gpt2bpe":
            tok = GPT2BPETokenizer(cfg.vocab_file, cfg.merges_file)
            shutil.copyfile(cfg.vocab_file, tmp / "vocab.json")
            shutil.copyfile(cfg.merges_file, tmp / "merges.txt")
            meta["tokenizer_path"], meta["merges_path"] = "vocab.json", "merges.txt"
        elif cfg.tokenizer_model is not None:
            tok = SentencePieceTokenizer(cfg.tokenizer_model)
            shutil.copyfile(cfg.tokenizer_model, tmp / "tokenizer.model")
            meta["tokenizer_path"] = "tokenizer.model"
        else:
            sample = _training_sample(files)
            first = next(sample, None)
            if first is None:
                raise _empty_corpus_error(cfg, files)
            train_sentencepiece(_chain(first, sample), cfg.tokenizer_vocab_size,
                                tmp / "tokenizer.model", threads=min(os.cpu_count() or 1, 8))
            meta["tokenizer_path"] = "tokenizer.model"
            tok = SentencePieceTokenizer(tmp / "tokenizer.model")
        dtype = DType.optimal_dtype(tok.vocab_size)
        builder = IndexedDatasetBuilder(str(tmp / "data.bin"), dtype=dtype)
        num_docs = num_seqs = num_tokens = 0
        for batch in _batches(iter_documents(files)):
            pieces = [split_into_sequences(doc) for doc in batch]
            flat = [p for doc in pieces for p in doc]
            encoded = iter(tok.encode_batch(flat, workers))
            for doc in pieces:
                seqs = [next(encoded) for _ in doc]
                seqs[-1] = list(seqs[-1]) + [tok.eod_id]
                seqs = [s for s in seqs if s]  # a given model may encode blank text to nothing
                lengths = [len(s) for s in seqs]
                builder.add_document(numpy.concatenate([numpy.asarray(s, dtype=numpy.int64)
                                                        for s in seqs]), lengths)
                num_docs += 1
                num_seqs += len(seqs)
                num_tokens += sum(lengths)
        builder.finalize(str(tmp / "data.idx"))
        if num_docs == 0:
            raise _empty_corpus_error(cfg, files)
        meta.update(vocab_size=tok.vocab_size, eod_id=tok.eod_id, num_tokens=num_tokens,
                    num_documents=num_docs, num_sequences=num_seqs)
        _write_json_atomic(tmp / _META, meta)
        if directory.exists() and not _is_complete(directory):
            shutil.rmtree(directory)  # not ours (builds only ever rename complete directories)
        try:
            os.rename(tmp, directory)
        except OSError:
            if not _is_complete(directory):  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _batches(docs: Iterator[str], max_chars: int = 8_000_000, max_docs: int = 4096):
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= max_chars or len(batch) >= max_docs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _pair_fix(field_name: str, prefix: str) -> str:
    """What to do about a broken .bin/.idx pair: rebuild a prepared cache, or re-create a prefix."""
    if field_name == "data.data_prefix":
        return ("re-create the pair (megatron-moe-prepare-data --output-prefix PREFIX) or point "
                "data.data_prefix at an intact copy")
    return (f"delete {Path(prefix).parent} and run again: the prepared data is rebuilt from "
            "data.paths")


def _read_idx_header(prefix: str, field_name: str) -> tuple[int, int, int]:
    """(sequence count, document count, token dtype itemsize) of ``prefix.idx``.

    Checks the pair is whole before megatron-core maps it: the .idx header (magic, version,
    dtype), the .idx size its counts imply, its last document index, and the .bin size its
    last sequence pointer and length imply. A truncated or mixed-up pair raises ValueError
    naming ``field_name``, the file and the fix."""
    from megatron.core.datasets.indexed_dataset import DType

    for ext in (".bin", ".idx"):
        if not Path(prefix + ext).is_file():
            raise FileNotFoundError(f"{field_name}: {prefix}{ext} does not exist (a megatron "
                                    "prefix needs both PREFIX.bin and PREFIX.idx)")
    fix = _pair_fix(field_name, prefix)
    idx_size = os.path.getsize(prefix + ".idx")
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != b"MMIDIDX\x00\x00":
        raise ValueError(f"{field_name}: {prefix}.idx is not a megatron-core index file "
                         f"({idx_size} bytes, no MMIDIDX header): {fix}")
    version, = struct.unpack("<Q", head[9:17])
    code = head[17]
    try:
        itemsize = DType.size(code)
    except (ValueError, KeyError):
        itemsize = 0
    if version != 1 or itemsize == 0:
        raise ValueError(f"{field_name}: {prefix}.idx has an unknown version ({version}) or token "
                         f"dtype code ({code}): it is corrupt or from another tool; {fix}")
    num_seqs, num_docs = struct.unpack("<QQ", head[18:34])
    want = 34 + 12 * num_seqs + 8 * num_docs  # int32 lengths, int64 pointers, int64 doc indices
    if idx_size not in (want, want + num_seqs):  # (+ int8 modes: multimodal)
        raise ValueError(f"{field_name}: {prefix}.idx has {idx_size} bytes but its header ("
                         f"{num_seqs} sequences, {num_docs} document indices) needs {want}: the "
                         f"file is truncated or corrupt; {fix}")
    want_bin = 0
    if num_seqs:
        with open(prefix + ".idx", "rb") as f:
            f.seek(34 + 4 * (num_seqs - 1))
            last_len, = struct.unpack("<i", f.read(4))
            f.seek(34 + 4 * num_seqs + 8 * (num_seqs - 1))
            last_ptr, = struct.unpack("<q", f.read(8))
            f.seek(34 + 12 * num_seqs + 8 * (num_docs - 1))
            last_doc, = struct.unpack("<q", f.read(8))
        if last_len < 0 or last_ptr < 0 or last_doc != num_seqs:
            raise ValueError(f"{field_name}: {prefix}.idx is corrupt (its last sequence or "
                             f"document entry is out of range): {fix}")
        want_bin = last_ptr + last_len * itemsize
    bin_size = os.path.getsize(prefix + ".bin")
    if bin_size != want_bin:
        raise ValueError(f"{field_name}: {prefix}.bin has {bin_size} bytes but {prefix}.idx "
                         f"describes {want_bin}: the .bin is truncated or the two files come "
                         f"from different builds; {fix}")
    return num_seqs, num_docs - 1, itemsize


def _check_token_ids(prefix: str, itemsize: int, vocab_size: int, field_name: str,
                     tokenizer_path: str) -> None:
    """The first and last million token ids of ``prefix.bin`` must be < ``vocab_size``; else the
    data came from another tokenizer (or the .bin is corrupt)."""
    import numpy

    dtype = {1: numpy.uint8, 2: numpy.uint16, 4: numpy.int32}.get(itemsize, numpy.int64)
    num_tokens = os.path.getsize(prefix + ".bin") // itemsize
    n = min(num_tokens, 1 << 20)
    with open(prefix + ".bin", "rb") as f:
        head = numpy.fromfile(f, dtype=dtype, count=n)
        f.seek((num_tokens - n) * itemsize)
        tail = numpy.fromfile(f, dtype=dtype, count=n)
    for part in (head, tail):
        if part.size and (int(part.max()) >= vocab_size or int(part.min()) < 0):
            bad = int(part.max()) if int(part.max()) >= vocab_size else int(part.min())
            raise ValueError(
                f"{field_name}: {prefix}.bin holds token id {bad} but the tokenizer "
                f"({tokenizer_path}) has only {vocab_size}: the data was made with another "
                f"tokenizer, or the .bin is corrupt; {_pair_fix(field_name, prefix)}"
            )


def _existing_prefix(cfg: DataConfig) -> PreparedData:
    """``data.data_prefix``: its sidecar PREFIX.json (written by megatron-moe-prepare-data) or
    the tokenizer named in the config tells the vocabulary."""
    prefix = cfg.data_prefix
    num_seqs, num_docs, itemsize = _read_idx_header(prefix, "data.data_prefix")
    sidecar = Path(prefix + ".json")
    tokenizer_given = cfg.tokenizer_model is not None or cfg.vocab_file is not None
    if tokenizer_given:
        tok = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model or cfg.vocab_file,
                             cfg.merges_file)
        prepared = PreparedData(
            prefix=prefix, tokenizer_path=tok.path, vocab_size=tok.vocab_size,
            eod_id=tok.eod_id, num_tokens=0, tokenizer_type=cfg.tokenizer_type,
            merges_path=cfg.merges_file, num_documents=num_docs, num_sequences=num_seqs,
        )
    elif sidecar.is_file():
        prepared = _meta_to_prepared(json.loads(sidecar.read_text()), sidecar.parent, Path(prefix))
    else:
        raise ValueError(
            f"data.data_prefix: {prefix} has no {sidecar.name} naming its tokenizer: set "
            "data.tokenizer_model (sentencepiece) or data.tokenizer_type: gpt2bpe with "
            "data.vocab_file and data.merges_file to the tokenizer the data was made with"
        )
    num_tokens = os.path.getsize(prefix + ".bin") // itemsize
    # The first and last million token ids must fit the tokenizer, else the data came from
    # another one.
    _check_token_ids(prefix, itemsize, prepared.vocab_size, "data.data_prefix",
                     prepared.tokenizer_path)
    return dataclasses.replace(prepared, num_tokens=num_tokens, num_documents=num_docs,
                               num_sequences=num_seqs)


def export_prefix(prepared: PreparedData, output_prefix: str | os.PathLike) -> PreparedData:
    """Copy prepared data to ``OUTPUT.bin/.idx`` with its tokenizer and an ``OUTPUT.json``
    sidecar, so that ``data.data_prefix: OUTPUT`` finds everything (paths stored relative)."""
    out = Path(output_prefix).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    names = {"tokenizer_path": out.name + (".vocab.json" if prepared.tokenizer_type == "gpt2bpe"
                                           else ".model")}
    copies = [(prepared.prefix + ".bin", f"{out}.bin"), (prepared.prefix + ".idx", f"{out}.idx"),
              (prepared.tokenizer_path, str(out.parent / names["tokenizer_path"]))]
    if prepared.merges_path:
        names["merges_path"] = out.name + ".merges.txt"
        copies.append((prepared.merges_path, str(out.parent / names["merges_path"])))
    for src, dst in copies:
        tmp = f"{dst}.tmp-{os.getpid()}"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    meta = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(prepared)}
    meta.pop("prefix")
    meta.update(names, format=FORMAT_VERSION)
    _write_json_atomic(Path(f"{out}.json"), meta)
    return _meta_to_prepared(meta, out.parent, out)


# ----------------------------------------------------------------------------------------------
# GPTDataset splits
# ----------------------------------------------------------------------------------------------


class _DatasetTokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer: vocab size, EOD, and identifiers
    for its index-cache hash (with the .idx file's size and mtime, so that data rewritten in
    place under the same prefix gets fresh indices)."""

    def __init__(self, prepared: PreparedData):
        self.vocab_size = prepared.vocab_size
        self.eod = prepared.eod_id
        st = os.stat(prepared.prefix + ".idx")
        self.unique_identifiers = {"class": "megatron_moe", "type": prepared.tokenizer_type,
                                   "vocab_size": prepared.vocab_size, "eod": prepared.eod_id,
                                   "idx": [st.st_size, st.st_mtime_ns]}


def _require_helpers() -> None:
    import sys

    try:
        from megatron.core.datasets import helpers  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "megatron-core's compiled dataset helpers (megatron/core/datasets/helpers_cpp) do not "
            f"import on Python {sys.version_info.major}.{sys.version_info.minor} ({e}): install "
            "the binary megatron-core wheel built for this Python (pip install --force-reinstall "
            "megatron-core==0.16.1: its manylinux wheels, cp311 and cp312 alike, contain "
            "helpers_cpp)"
        ) from None


def _npy_loads(path: Path) -> bool:
    import numpy

    try:
        numpy.load(path, mmap_mode="r")  # a truncated file cannot be mapped
        return True
    except (OSError, ValueError, EOFError):
        return False


def _drop_incomplete_index_caches(directory: Path) -> None:
    """megatron-core writes its GPTDataset index caches in place (description first, then three
    .npy files); a crash mid-write would leave a set that fails to load. Remove such sets."""
    if not directory.is_dir():
        return
    for desc in directory.glob("*-description.txt"):
        base = desc.name[: -len("description.txt")]
        npys = [directory / f"{base}{k}_index.npy" for k in ("document", "sample", "shuffle")]
        if not all(_npy_loads(p) for p in npys):
            for p in [desc, *npys]:
                p.unlink(missing_ok=True)


def build_datasets(data_cfg: DataConfig, prepared: PreparedData, *, seq_length: int, seed: int,
                   num_samples: tuple[int, int, int], model_vocab_size: int):
    """megatron-core ``GPTDataset`` (train, valid, test) over ``prepared.prefix``.

    ``num_samples[i]`` sequences of ``seq_length`` tokens are drawn from split i (epochs
    repeat as needed; None = one epoch). A split whose weight in ``data.split`` is 0 is
    None. Each item: ``{"tokens", "labels", "loss_mask", "position_ids"}`` (no attention
    mask: attention is causal). Call on every rank (rank 0 builds the index caches first).
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if prepared.vocab_size > model_vocab_size:
        raise ValueError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary "
            f"({prepared.vocab_size} tokens, {prepared.tokenizer_path}): set model.vocab_size >= "
            f"{prepared.vocab_size}, or train a smaller tokenizer (data.tokenizer_vocab_size)"
        )
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r} must be a positive integer")
    if len(num_samples) != 3 or not all(
        n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 0)
        for n in num_samples
    ):
        raise ValueError(f"num_samples={num_samples!r} must be three counts (train, valid, test)")
    field_name = "data.data_prefix" if data_cfg.data_prefix is not None else "prepared data"
    num_seqs, _, itemsize = _read_idx_header(prepared.prefix, field_name)
    if field_name != "data.data_prefix":  # a data_prefix was checked by prepare_data already
        _check_token_ids(prepared.prefix, itemsize, prepared.vocab_size, field_name,
                         prepared.tokenizer_path)
    for name, (lo, hi) in zip(("train", "valid", "test"),
                              _split_bookends(split_weights(data_cfg.split))):
        if hi > lo and int(round(hi * num_seqs)) <= int(round(lo * num_seqs)):
            raise ValueError(
                f"data.split={data_cfg.split!r} leaves the {name} split without sequences: "
                f"{prepared.prefix} has only {num_seqs}; add text or give {name} a larger "
                f"share (a 0 weight drops the split)"
            )
    _require_helpers()
    index_dir = Path(data_cfg.cache_dir) / "gpt_indices"
    if not _distributed() or torch.distributed.get_rank() == 0:
        _drop_incomplete_index_caches(index_dir)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prepared.prefix], None),
        split=data_cfg.split, path_to_cache=str(index_dir), tokenizer=_DatasetTokenizer(prepared),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mmap_bin_files=True,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, config)
    train, valid, test = builder.build()
    return train, valid, test


def split_tokens(dataset) -> int | None:
    """Tokens in one epoch of a split built by :func:`build_datasets` (its documents' lengths
    summed, EOD tokens included), or None for a missing split or another dataset type."""
    try:
        return int(dataset.dataset.sequence_lengths[dataset.indices].sum())
    except AttributeError:
        return None


def _split_bookends(weights: list[float]) -> list[tuple[float, float]]:
    out, lo = [], 0.0
    for w in weights:
        out.append((lo, lo + w))
        lo += w
    return out
