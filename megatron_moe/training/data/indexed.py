"""A megatron-core .bin/.idx pair written as the sequences arrive, in bounded memory.

    with IndexedWriter("out/data", numpy.uint16) as out:   # writes out/data.bin, out/data.idx
        out.write([[5, 7, 2], [9, 4], [3, 2]], [True, False, True])  # ends of documents
    out.num_sequences, out.num_documents, out.num_tokens   # 3, 2, 7

The .idx holds what megatron-core's ``IndexedDatasetBuilder`` writes, byte for byte: the header
(magic, version 1, token dtype code), the sequence and document counts, int32 sequence lengths,
int64 byte pointers into the .bin and int64 document boundaries. The builder keeps every length
and boundary in Python lists until ``finalize`` (tens of bytes per sequence, then copies of all
of them at once); here they go to two scratch files beside the .bin, which the end of the
``with`` block streams into the .idx in blocks and removes.
"""
from __future__ import annotations

import itertools
import os
import shutil
import struct
from typing import Sequence

import numpy

_MAGIC = b"MMIDIDX\x00\x00"
_BLOCK = 1 << 20
"""Entries per block when the scratch files are streamed into the .idx."""


class IndexedWriter:
    """Appends sequences of token ids to ``prefix.bin``; ``prefix.idx`` is written on leaving
    the ``with`` block (on an exception only the files are closed)."""

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix, self.dtype = str(prefix), numpy.dtype(dtype)
        self._bin = open(self.prefix + ".bin", "wb")
        self._lengths = open(self.prefix + ".lengths.tmp", "wb")
        self._ends = open(self.prefix + ".ends.tmp", "wb")
        self._ends.write(numpy.zeros(1, numpy.int64).tobytes())  # documents[0] starts at 0
        self.num_sequences = self.num_documents = self.num_tokens = 0

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for f in (self._bin, self._lengths, self._ends):
            f.close()
        if exc_type is None:
            self._write_idx()
        for name in (".lengths.tmp", ".ends.tmp"):
            os.remove(self.prefix + name)

    def write(self, sequences: Sequence[Sequence[int]], ends_document: Sequence[bool]) -> None:
        """Append ``sequences`` (lists of token ids); ``ends_document[i]``: sequence i is the
        last of its document."""
        lengths = numpy.fromiter(map(len, sequences), numpy.int32, len(sequences))
        tokens = numpy.fromiter(itertools.chain.from_iterable(sequences), self.dtype,
                                int(lengths.sum(dtype=numpy.int64)))
        self._bin.write(tokens.tobytes())
        self._lengths.write(lengths.tobytes())
        ends = self.num_sequences + 1 + numpy.flatnonzero(numpy.asarray(ends_document, bool))
        self._ends.write(ends.astype(numpy.int64).tobytes())
        self.num_sequences += len(sequences)
        self.num_documents += len(ends)
        self.num_tokens += tokens.size

    def _write_idx(self) -> None:
        from megatron.core.datasets.indexed_dataset import DType

        code = DType.code_from_dtype(self.dtype.type)
        with open(self.prefix + ".idx", "wb") as idx:
            idx.write(_MAGIC + struct.pack("<QB", 1, code))
            idx.write(struct.pack("<QQ", self.num_sequences, self.num_documents + 1))
            with open(self.prefix + ".lengths.tmp", "rb") as f:
                shutil.copyfileobj(f, idx)
            with open(self.prefix + ".lengths.tmp", "rb") as f:  # pointers: bytes before each
                offset = 0
                while (lengths := numpy.fromfile(f, numpy.int32, _BLOCK)).size:
                    sizes = lengths.astype(numpy.int64) * self.dtype.itemsize
                    ends = offset + numpy.cumsum(sizes)
                    idx.write((ends - sizes).tobytes())
                    offset = int(ends[-1])
            with open(self.prefix + ".ends.tmp", "rb") as f:
                shutil.copyfileobj(f, idx)
