"""megatron-moe-prepare-data: tokenize a corpus into megatron-core .bin/.idx ahead of training.

Training prepares its data itself (``megatron_moe.training.data.prepare_data``, cached under
``data.cache_dir``); this command does the same work up front, prints a summary
(documents, tokens, vocabulary) and can export a self-contained prefix. Also:
``python tools/prepare_data.py ...`` and ``python -m megatron_moe.training.data.prepare_cli ...``.

    # the default corpus (Python standard library sources), sentencepiece trained on it
    megatron-moe-prepare-data

    # exactly the data a run config will use (fills its cache_dir, checks model.vocab_size)
    megatron-moe-prepare-data --config configs/gpt-xs.yaml

    # The Pile's JSONL ({"text": ...} per line; .jsonl.zst needs `pip install zstandard`)
    megatron-moe-prepare-data --input /data/pile/train/00.jsonl --vocab-size 50000 \\
        --output-prefix data/pile00
    megatron-moe-train --config configs/gpt-xs.yaml data.data_prefix=data/pile00

    # a folder of .txt files (searched recursively; one file = one document)
    megatron-moe-prepare-data --input my_texts/ --vocab-size 16000 --output-prefix data/mytexts

    # a GPT-2 byte-level BPE vocab/merges pair (vocabulary 50257 fits model.vocab_size 51200)
    megatron-moe-prepare-data --input /data/pile/train/00.jsonl --tokenizer-type gpt2bpe \\
        --vocab-file gpt2/vocab.json --merges-file gpt2/merges.txt --workers 16 \\
        --output-prefix data/pile00-gpt2

``--output-prefix OUT`` writes ``OUT.bin``, ``OUT.idx``, the tokenizer (``OUT.model``, or
``OUT.vocab.json`` + ``OUT.merges.txt``) and ``OUT.json`` (what ``data.data_prefix: OUT``
reads to find the tokenizer). Bad input exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from . import TOKENIZER_TYPES, DataConfig, export_prefix, prepare_data


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-moe-prepare-data",
        description="Tokenize text / JSONL files (default: Python stdlib sources) into "
                    "megatron-core .bin/.idx.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", help="a run config: start from its data: section "
                                    "(and check its model.vocab_size)")
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text / .jsonl files or directories (data.paths); none = the default "
                        "corpus")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="data.tokenizer_type")
    p.add_argument("--tokenizer-model", help="an existing sentencepiece .model "
                                             "(data.tokenizer_model); none = train one")
    p.add_argument("--vocab-file", help="gpt2bpe vocab.json (data.vocab_file)")
    p.add_argument("--merges-file", help="gpt2bpe merges.txt (data.merges_file)")
    p.add_argument("--vocab-size", type=int,
                   help="pieces of a trained sentencepiece model (data.tokenizer_vocab_size)")
    p.add_argument("--cache-dir", help="where prepared data is cached (data.cache_dir)")
    p.add_argument("--output-prefix", metavar="OUT",
                   help="also write OUT.bin/.idx + tokenizer + OUT.json for data.data_prefix")
    p.add_argument("--workers", type=int, default=None,
                   help="encoding threads (sentencepiece) or processes (gpt2bpe); "
                        "default: all cores / one process")
    return p


def _data_config(args) -> tuple[DataConfig, int | None]:
    model_vocab = None
    if args.config:
        from ..run_config import load_config

        run = load_config(args.config, [])
        cfg, model_vocab = run.data, run.model.vocab_size
    else:
        cfg = DataConfig()
    changes = {
        "paths": args.input, "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": args.tokenizer_model, "vocab_file": args.vocab_file,
        "merges_file": args.merges_file, "tokenizer_vocab_size": args.vocab_size,
        "cache_dir": args.cache_dir,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.input:
        changes["data_prefix"] = None
    if changes.get("tokenizer_type") == "gpt2bpe":
        changes.setdefault("tokenizer_model", None)
    elif changes.get("tokenizer_type") == "sentencepiece":
        changes.setdefault("vocab_file", None)
        changes.setdefault("merges_file", None)
    return dataclasses.replace(cfg, **changes), model_vocab


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.workers is not None and args.workers < 1:
        _parser().error("--workers must be >= 1")
    try:
        cfg, model_vocab = _data_config(args)
        trains = cfg.tokenizer_type == "sentencepiece" and cfg.tokenizer_model is None
        if model_vocab is not None and trains and cfg.tokenizer_vocab_size > model_vocab:
            raise ValueError(f"data.tokenizer_vocab_size={cfg.tokenizer_vocab_size} exceeds "
                             f"model.vocab_size={model_vocab} of {args.config}")
        t0 = time.time()
        prepared = prepare_data(cfg, workers=args.workers)
        if model_vocab is not None and prepared.vocab_size > model_vocab:
            raise ValueError(f"model.vocab_size={model_vocab} in {args.config} is smaller than "
                             f"the tokenizer's vocabulary ({prepared.vocab_size})")
        if args.output_prefix:
            prepared = export_prefix(prepared, args.output_prefix)
        seconds = time.time() - t0
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-moe-prepare-data: error: {e}", file=sys.stderr)
        return 2
    corpus = ", ".join(cfg.paths) if cfg.paths else (
        cfg.data_prefix or f"Python sources, {cfg.default_corpus_mb:g} MB (stdlib, then site-packages)")
    print(f"corpus     {corpus}")
    print(f"documents  {prepared.num_documents:,} ({prepared.num_sequences:,} sequences)")
    print(f"tokens     {prepared.num_tokens:,}")
    print(f"vocab      {prepared.vocab_size:,} ({prepared.tokenizer_type}, eod id "
          f"{prepared.eod_id})")
    print(f"tokenizer  {prepared.tokenizer_path}"
          + (f" + {prepared.merges_path}" if prepared.merges_path else ""))
    print(f"prefix     {prepared.prefix}  ({seconds:.1f} s)")
    if args.output_prefix:
        print(f"train on it: megatron-moe-train --config CONFIG "
              f"data.data_prefix={prepared.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
