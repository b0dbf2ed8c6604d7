"""Preparation: documents -> tokenizer -> megatron-core .bin/.idx, cached by input.

    prepared = prepare_data(DataConfig())     # cached under data.cache_dir, keyed by the inputs
    prepared.prefix, prepared.vocab_size, prepared.tokenizer()
    export_prefix(prepared, "data/pile00")    # a self-describing copy for data.data_prefix

``data.bin``/``data.idx`` (megatron-core's format, written by :class:`IndexedWriter`) go into
``cache_dir/<name>-<hash>/``. The hash covers the input files (path, size, mtime), the
tokenizer settings and file contents, and this module's format version: a second run reuses
the directory, a changed input builds a new one. A build happens in a temporary directory
renamed into place when complete, so a crash never leaves a cache that loads. Memory stays
bounded whatever the corpus' size: the tokenizer trains on at most ``TOKENIZER_TRAIN_CHARS`` of
text, and the corpus is read, encoded and written piece by piece in batches of
``ENCODE_BATCH_CHARS`` characters (one JSONL line is the most ever held whole).
``data.data_prefix`` skips all this and uses an existing ``.bin``/``.idx`` pair, checked whole
(header, sizes, token ids within the tokenizer) before megatron-core maps it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .config import DataConfig
from .corpus import SEQUENCE_CHARS, Piece, default_corpus_files, iter_pieces, resolve_inputs
from .indexed import IndexedWriter
from .tokenizers import GPT2BPETokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece

FORMAT_VERSION = 2
"""Bump when the prepared layout or the tokenization changes: old caches are then ignored.
(2: lines longer than SEQUENCE_CHARS are cut too, no longer kept whole.)"""
TOKENIZER_TRAIN_CHARS = 10_000_000
"""At most this much text (the corpus' first sequences) trains a sentencepiece model: the
trainer holds all it is given (several times its size), so this bounds it."""
ENCODE_BATCH_CHARS = 1_000_000
"""Pieces are encoded and written in batches of about this many characters (or
``ENCODE_BATCH_PIECES`` pieces): what preparation holds at a time, token lists included."""
ENCODE_BATCH_PIECES = 8192




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


def is_distributed() -> bool:
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
    from ..distributed import barrier

    barrier()  # (a world of one process: nothing to wait for)
    if not _is_complete(directory):
        _build(data_cfg, files, directory, workers)
    meta = json.loads((directory / _META).read_text())
    return _meta_to_prepared(meta, directory, directory / "data")


def _training_sample(files: list[Path]) -> Iterator[str]:
    total = 0
    for piece in iter_pieces(files):
        yield piece.text
        total += len(piece.text)
        if total >= TOKENIZER_TRAIN_CHARS:
            return


def _empty_corpus_error(cfg: DataConfig, files: list[Path]) -> ValueError:
    shown = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    return ValueError(f"data.paths: no text in the {len(files)} input file(s) ({shown}): the "
                      "corpus is empty (empty files, or JSONL lines with empty \"text\")")


def _build(cfg: DataConfig, files: list[Path], directory: Path, workers: int | None) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".tmp-{directory.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = {"tokenizer_type": cfg.tokenizer_type, "merges_path": None,
                "format": FORMAT_VERSION, "inputs": [str(f) for f in files]}
        tok = _tokenizer(cfg, files, tmp, meta)
        try:
            out = _write_corpus(tok, files, tmp / "data", workers)
        finally:
            tok.close()
        if out.num_documents == 0:
            raise _empty_corpus_error(cfg, files)
        meta.update(vocab_size=tok.vocab_size, eod_id=tok.eod_id, num_tokens=out.num_tokens,
                    num_documents=out.num_documents, num_sequences=out.num_sequences)
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


def _tokenizer(cfg: DataConfig, files: list[Path], tmp: Path, meta: dict):
    """The tokenizer, copied (or trained) into ``tmp``; its file names go into ``meta``.
    A given tokenizer is loaded from the user's files first, so that errors name them."""
    if cfg.tokenizer_type == "gpt2bpe":
        tok = GPT2BPETokenizer(cfg.vocab_file, cfg.merges_file)
        shutil.copyfile(cfg.vocab_file, tmp / "vocab.json")
        shutil.copyfile(cfg.merges_file, tmp / "merges.txt")
        meta["tokenizer_path"], meta["merges_path"] = "vocab.json", "merges.txt"
        return tok
    meta["tokenizer_path"] = "tokenizer.model"
    if cfg.tokenizer_model is not None:
        tok = SentencePieceTokenizer(cfg.tokenizer_model)
        shutil.copyfile(cfg.tokenizer_model, tmp / "tokenizer.model")
        return tok
    sample = _training_sample(files)
    first = next(sample, None)
    if first is None:
        raise _empty_corpus_error(cfg, files)
    train_sentencepiece(_chain(first, sample), cfg.tokenizer_vocab_size,
                        tmp / "tokenizer.model", threads=min(os.cpu_count() or 1, 8))
    return SentencePieceTokenizer(tmp / "tokenizer.model")


def _write_corpus(tok, files: list[Path], prefix: Path, workers: int | None) -> IndexedWriter:
    """Encode the corpus batch by batch into ``prefix.bin/.idx``: one stored sequence per piece,
    EOD after each document's last piece."""
    from megatron.core.datasets.indexed_dataset import DType

    with IndexedWriter(prefix, DType.optimal_dtype(tok.vocab_size)) as out:
        for batch in _batches(iter_pieces(files)):
            sequences, ends = [], []
            for piece, ids in zip(batch, _encode(tok, batch, workers)):
                if piece.last:
                    ids = list(ids) + [tok.eod_id]
                if ids:  # a given model may encode blank text to nothing
                    sequences.append(ids)
                    ends.append(piece.last)
            out.write(sequences, ends)
    return out


def _encode(tok, batch: list[Piece], workers: int | None) -> list[list[int]]:
    """``tok.encode_batch`` of the pieces' texts; a piece the tokenizer fails on raises
    ValueError naming its file and line (the batch is encoded again one piece at a time to find
    it, only then)."""
    try:
        return tok.encode_batch([p.text for p in batch], workers)
    except (ValueError, RuntimeError, UnicodeError) as e:
        error = e
    for piece in batch:
        try:
            tok.encode(piece.text)
        except (ValueError, RuntimeError, UnicodeError) as e:
            raise ValueError(f"{piece.path}:{piece.line}: the tokenizer cannot encode this "
                             f"document: {str(e).splitlines()[0]}") from None
    raise error


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Consecutive pieces in lists of about ``ENCODE_BATCH_CHARS`` characters (or
    ``ENCODE_BATCH_PIECES`` pieces)."""
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= ENCODE_BATCH_CHARS or len(batch) >= ENCODE_BATCH_PIECES:
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


def read_idx_header(prefix: str, field_name: str) -> tuple[int, int, int]:
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


def check_token_ids(prefix: str, itemsize: int, vocab_size: int, field_name: str,
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
    num_seqs, num_docs, itemsize = read_idx_header(prefix, "data.data_prefix")
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
    check_token_ids(prefix, itemsize, prepared.vocab_size, "data.data_prefix",
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
