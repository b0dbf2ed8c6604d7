"""megatron-core GPTDataset splits (train, valid, test) over prepared data.

    train, valid, test = build_datasets(cfg, prepared, seq_length=256, seed=1234,
                                        num_samples=(4096, 512, 64), model_vocab_size=8192)
    train[0]  # {"tokens", "labels", "loss_mask", "position_ids"}: tensors of length 256

``data.split`` (e.g. ``"969,30,1"``) splits the corpus' sequences; the index caches go to
``cache_dir/gpt_indices``. megatron-core's compiled helpers (``helpers_cpp``) ship inside its
binary wheels (cp311 and cp312 alike); nothing is compiled at run time.

A split read more than ``MAX_INDEX_EPOCHS`` times is indexed for that many epochs and read in a
cycle (:class:`Cycled`): megatron-core's index holds every epoch (about 20 bytes per sequence
and epoch while it is built), so a small corpus of short documents read thousands of times
would need gigabytes for it.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from .config import DataConfig, split_weights
from .preparation import PreparedData, check_token_ids, is_distributed, read_idx_header

MAX_INDEX_EPOCHS = 16
"""A split needing more epochs than this is indexed for this many and read in a cycle: the
index then holds at most 16 epochs' entries, however long the run."""



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
        importlib.import_module("megatron.core.datasets.helpers")
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
    repeat as needed, beyond ``MAX_INDEX_EPOCHS`` in a cycle; None = one epoch). A split whose
    weight in ``data.split`` is 0 is None. Each item: ``{"tokens", "labels", "loss_mask",
    "position_ids"}`` (no attention mask: attention is causal). Call on every rank (rank 0
    builds the index caches first).
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
    num_seqs, _, itemsize = read_idx_header(prepared.prefix, field_name)
    if field_name != "data.data_prefix":  # a data_prefix was checked by prepare_data already
        check_token_ids(prepared.prefix, itemsize, prepared.vocab_size, field_name,
                         prepared.tokenizer_path)
    bookends = _split_bookends(split_weights(data_cfg.split))
    for name, (lo, hi) in zip(("train", "valid", "test"), bookends):
        if hi > lo and int(round(hi * num_seqs)) <= int(round(lo * num_seqs)):
            raise ValueError(
                f"data.split={data_cfg.split!r} leaves the {name} split without sequences: "
                f"{prepared.prefix} has only {num_seqs}; add text or give {name} a larger "
                f"share (a 0 weight drops the split)"
            )
    _require_helpers()
    index_dir = Path(data_cfg.cache_dir) / "gpt_indices"
    if not is_distributed() or torch.distributed.get_rank() == 0:
        _drop_incomplete_index_caches(index_dir)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prepared.prefix], None),
        split=data_cfg.split, path_to_cache=str(index_dir), tokenizer=_DatasetTokenizer(prepared),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mmap_bin_files=True,
    )
    tokens = _split_token_counts(prepared.prefix, num_seqs, bookends)
    indexed = [_indexed_samples(n, t, seq_length) for n, t in zip(num_samples, tokens)]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, indexed, lambda: True, config)
    return tuple(ds if ds is None or n is None or n <= len(ds) else Cycled(ds, n)
                 for ds, n in zip(builder.build(), num_samples))


def _split_token_counts(prefix: str, num_seqs: int, bookends) -> list[int]:
    """Tokens in each split's sequences, as megatron-core splits them (sequence
    ``round(lo * num_seqs)`` up to ``round(hi * num_seqs)``), read from the .idx's lengths."""
    import numpy

    lengths = numpy.memmap(prefix + ".idx", numpy.int32, "r", offset=34, shape=(num_seqs,))
    bounds = [(int(round(lo * num_seqs)), int(round(hi * num_seqs))) for lo, hi in bookends]
    return [int(lengths[lo:hi].sum(dtype=numpy.int64)) for lo, hi in bounds]


def _indexed_samples(num_samples: int | None, split_tokens: int, seq_length: int) -> int | None:
    """The samples megatron-core is asked to index for a split: ``num_samples``, or as many as
    ``MAX_INDEX_EPOCHS`` epochs hold when that is fewer (megatron-core counts an epoch's
    samples as (tokens - 1) // seq_length: each sample reads one token past its end)."""
    if num_samples is None or split_tokens == 0:
        return num_samples
    return min(num_samples, max(1, (MAX_INDEX_EPOCHS * split_tokens - 1) // seq_length))


class Cycled:
    """``num_samples`` samples of a GPTDataset indexed for fewer: sample i is
    ``dataset[i % len(dataset)]``. Other attributes are the dataset's (:func:`split_tokens`
    reads its ``dataset`` and ``indices``)."""

    def __init__(self, dataset, num_samples: int):
        self.cycled, self.num_samples = dataset, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        return self.cycled[i % len(self.cycled)]

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "cycled":  # pickle and copy ask before __init__ ran
            raise AttributeError(name)
        return getattr(self.cycled, name)


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


class MicroBatchSampler:
    """Index lists of this rank's micro-batches, in order, from ``start`` consumed samples.

    Global step g covers samples [g*B, (g+1)*B) (B = global batch), cut into chunks of
    micro*dp samples; in each chunk rank r takes [r*micro, (r+1)*micro). A function of the
    consumed-sample count alone, so a resumed run reads exactly what a straight run reads.
    """

    def __init__(self, start: int, end: int, micro: int, rank: int, dp: int):
        self.start, self.end, self.micro, self.rank, self.dp = start, end, micro, rank, dp

    def __iter__(self):
        chunk = self.micro * self.dp
        s = self.start
        while s + chunk <= self.end:
            lo = s + self.rank * self.micro
            yield list(range(lo, lo + self.micro))
            s += chunk

    def __len__(self) -> int:
        return max(0, (self.end - self.start) // (self.micro * self.dp))


def micro_batch_loader(dataset, sampler: MicroBatchSampler, device, seed: int):
    """A DataLoader over ``sampler``'s micro-batches: worker processes on GPUs, its own generator
    (the global torch RNG is not drawn from)."""
    import torch

    cuda = device.type == "cuda"
    gen = torch.Generator()
    gen.manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2 if cuda else 0,
                                       pin_memory=cuda, generator=gen)
