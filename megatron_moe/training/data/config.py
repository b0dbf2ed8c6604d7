"""The ``data:`` section of a run config (DataConfig), validated on construction.

Invalid values raise one ``ValueError`` naming ``data.<key>`` and what would be valid.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from megatron_moe._validation import invalid, is_number

DEFAULT_CORPUS_BYTES = 4_000_000
"""Size of the default corpus (Python stdlib sources, whole files in sorted order); the
``data.default_corpus_mb`` of a run config overrides it."""
TOKENIZER_TYPES = ("sentencepiece", "gpt2bpe")
MIN_SENTENCEPIECE_VOCAB = 260
"""256 byte-fallback pieces + unk, bos, eos + at least one more."""




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
    invalid(f"data.{name}", value, valid)


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
    if not is_number(mb) or mb <= 0:
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
