"""Tokenizers: sentencepiece (trained here or loaded) and GPT-2's byte-level BPE (plain Python).

    train_sentencepiece(texts, 8000, "tok.model")
    tok = load_tokenizer("sentencepiece", "tok.model")    # or ("gpt2bpe", "vocab.json", "merges.txt")
    tok.encode(text), tok.decode(ids), tok.vocab_size, tok.eod_id

sentencepiece: BPE with byte fallback, identity normalisation and whitespace kept, so
``decode(encode(text)) == text``. gpt2bpe: GPT-2's ``vocab.json`` + ``merges.txt``, EOD
``<|endoftext|>``.
"""
from __future__ import annotations

import io
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Iterable

from .corpus import SEQUENCE_CHARS

_EOD_GPT2 = "<|endoftext|>"




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

    def close(self) -> None:
        """Nothing to release (encode_batch's threads end with each call)."""


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
    sentences = _KeepsError(texts)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_writer=buf, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, character_coverage=0.9995,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            max_sentence_length=4 * SEQUENCE_CHARS + 1024, shuffle_input_sentence=False,
            input_sentence_size=0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=threads, minloglevel=2,
        )
    except RuntimeError as e:
        if sentences.error is not None:  # the texts' own error (a bad JSONL line), not the size's
            raise sentences.error from None
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


class _KeepsError:
    """Iterates ``texts`` and keeps the exception it raised. sentencepiece's trainer turns an
    exception from its sentence iterator into a RuntimeError of its own ("INTERNAL: ValueError:
    ..."), which would read as a vocabulary-size problem; the kept one is raised instead."""

    def __init__(self, texts: Iterable[str]):
        self.texts, self.error = iter(texts), None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self.texts)
        except StopIteration:
            raise
        except BaseException as e:
            self.error = e
            raise


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
        self._workers, self._num_workers = None, 0

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
            chunk = max(1, len(texts) // (4 * workers))
            return self._pool(workers).map(_gpt2_worker_encode, texts, chunksize=chunk)
        return [self.encode(t) for t in texts]

    def _pool(self, workers: int):
        """``workers`` forked processes, started by the first batch and kept for the next ones
        (preparation encodes in small batches to bound its memory; a pool per batch would
        start the processes and read vocab and merges again each time). :meth:`close` ends them."""
        if self._workers is None or self._num_workers != workers:
            import multiprocessing as mp

            self.close()
            self._workers = mp.get_context("fork").Pool(workers, _gpt2_worker_init,
                                                        (self.path, self.merges_path))
            self._num_workers = workers
        return self._workers

    def close(self) -> None:
        """End the encoding processes, if any."""
        if self._workers is not None:
            self._workers.terminate()
            self._workers.join()
            self._workers = None

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
