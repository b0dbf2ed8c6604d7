"""Documents: the files named by ``data.paths`` (or the default corpus) as a stream of texts.

    files = resolve_inputs(["pile/00.jsonl", "notes/"])   # or default_corpus_files(4_000_000)
    for piece in iter_pieces(files): ...                  # piece.text, .path, .line, .last
    for text in iter_documents(files): ...                # whole documents
    split_into_sequences(text)                            # pieces of at most 2048 characters

``*.jsonl`` (also ``.jsonl.gz``; ``.jsonl.zst`` with the ``zstandard`` package) holds one
``{"text": ...}`` per line, The Pile's format; every other file is one plain-text document
(UTF-8). In directories only ``.txt .text .md .rst .py .jsonl`` (also as ``.gz``/``.zst``) are
read. The default corpus is a bounded, deterministic subset of the Python standard library's
``.py`` sources (then the installed packages'), found through ``sysconfig``: no download.

Memory: documents are read as pieces of at most ``SEQUENCE_CHARS`` characters (a text file in
blocks of ``READ_CHARS``), so reading holds one block or one JSONL line at a time, whatever
the corpus' or a document's size. A problem in the data raises ``ValueError`` starting with
``path:line:`` and saying what to change.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

from .config import DEFAULT_CORPUS_BYTES

SEQUENCE_CHARS = 2048
"""Documents are stored as sequences of at most this many characters (cut after a newline,
else after a space)."""
READ_CHARS = 1 << 20
"""A plain-text file is read in blocks of this many characters."""
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


class Piece(NamedTuple):
    """A piece of a document (at most ``SEQUENCE_CHARS`` characters) and where it comes from."""

    text: str
    path: Path
    line: int
    """The JSONL line of its document, or the line of a text file it starts on (from 1)."""
    last: bool
    """The last piece of its document."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def _jsonl_text(path: Path, lineno: int, line: str) -> str:
    """The "text" of one JSONL line; lone surrogate escapes (``"\\ud83d"`` without its pair,
    which no tokenizer can encode) become U+FFFD, as invalid UTF-8 bytes do when files are read."""
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
                         "not a string; each line must be {\"text\": \"...\"}")
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def _jsonl_pieces(path: Path, f) -> Iterator[Piece]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        text = _jsonl_text(path, lineno, line)
        del line  # a long line is held once, not twice, while its pieces are made
        done = 0
        for piece in _sequences(text, SEQUENCE_CHARS):
            done += len(piece)
            yield Piece(piece, path, lineno, done == len(text))


def _text_pieces(path: Path, f) -> Iterator[Piece]:
    """The pieces of a plain-text file, read in blocks: the cut points are those of
    :func:`split_into_sequences` on the whole text, since a cut is only made while more than
    ``SEQUENCE_CHARS`` characters follow the piece's start in the buffer."""
    buf, lineno, eof = "", 1, False
    while not eof:
        block = f.read(READ_CHARS)
        eof = not block
        buf += block
        start = 0
        while start < len(buf) and (eof or len(buf) - start > SEQUENCE_CHARS):
            end = _cut(buf, start, SEQUENCE_CHARS)
            piece = buf[start:end]
            yield Piece(piece, path, lineno, eof and end == len(buf))
            lineno += piece.count("\n")
            start = end
        buf = buf[start:]


def iter_pieces(files: Iterable[Path]) -> Iterator[Piece]:
    """The non-empty documents of ``files`` (a JSONL line's "text", or a whole text file) as
    pieces of at most ``SEQUENCE_CHARS`` characters, in order. A file that cannot be read
    (a truncated .gz, say) raises ``ValueError`` naming it."""
    for path in files:
        jsonl = _base_suffix(path) == ".jsonl"
        try:
            with _open_text(path) as f:
                yield from (_jsonl_pieces if jsonl else _text_pieces)(path, f)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e}); replace it if "
                             "it is truncated or corrupt, or leave it out of data.paths") from None


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    """Yield the non-empty documents of ``files``: a JSONL line's "text", or a whole text file
    (joined from :func:`iter_pieces`; preparation itself never holds a whole document)."""
    parts: list[str] = []
    for piece in iter_pieces(files):
        parts.append(piece.text)
        if piece.last:
            yield "".join(parts)
            parts = []


def _cut(text: str, start: int, max_chars: int) -> int:
    """Where the piece of ``text`` that starts at ``start`` ends: all of the rest if it is at
    most ``max_chars`` long, else after the last newline within ``max_chars``, else (a longer
    line) after the last space, else after ``max_chars`` characters."""
    end = start + max_chars
    if len(text) <= end:
        return len(text)
    cut = text.rfind("\n", start, end)
    if cut < 0:
        cut = text.rfind(" ", start, end)
    return cut + 1 if cut >= 0 else end


def _sequences(text: str, max_chars: int) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = _cut(text, start, max_chars)
        yield text[start:end]
        start = end


def split_into_sequences(text: str, max_chars: int = SEQUENCE_CHARS) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` characters: after a newline, or for a
    longer line after a space (or anywhere, in a line without spaces).

    ``"".join(split_into_sequences(t)) == t``. Every piece fits the tokenizer trainer's
    sentence limit (it skips longer ones), and a document without newlines (one long JSONL
    line) is encoded in small pieces, not as one string whose encoding needs tens of bytes
    per character.
    """
    return list(_sequences(text, max_chars)) or [text]
