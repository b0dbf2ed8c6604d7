"""Documents: the files named by ``data.paths`` (or the default corpus) as a stream of texts.

    files = resolve_inputs(["pile/00.jsonl", "notes/"])   # or default_corpus_files(4_000_000)
    for text in iter_documents(files): ...
    split_into_sequences(text)                            # pieces of ~2048 characters

``*.jsonl`` (also ``.jsonl.gz``; ``.jsonl.zst`` with the ``zstandard`` package) holds one
``{"text": ...}`` per line, The Pile's format; every other file is one plain-text document
(UTF-8). In directories only ``.txt .text .md .rst .py .jsonl`` (also as ``.gz``/``.zst``) are
read. The default corpus is a bounded, deterministic subset of the Python standard library's
``.py`` sources (then the installed packages'), found through ``sysconfig``: no download.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .config import DEFAULT_CORPUS_BYTES

SEQUENCE_CHARS = 2048
"""Documents are stored as sequences of about this many characters (cut after a newline)."""
DIR_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".jsonl")
"""Files read from a directory (also as ``.gz``/``.zst``); a named file is always read."""
_STDLIB_SKIP_DIRS = {
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "turtledemo",
    "lib2to3", "ensurepip", "encodings", "pydoc_data",
}
_STDLIB_MAX_FILE_BYTES = 256_000




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
