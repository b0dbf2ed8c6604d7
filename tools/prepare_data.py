"""Tokenize a corpus into megatron-core .bin/.idx: the same as `megatron-moe-prepare-data`.

    python tools/prepare_data.py                       # the default corpus (Python stdlib sources)
    python tools/prepare_data.py --input pile/00.jsonl --vocab-size 50000 --output-prefix data/pile00
    python tools/prepare_data.py --help

All options and more commands: megatron_moe/training/data/prepare_cli.py.
"""
import sys

from megatron_moe.training.data.prepare_cli import main

if __name__ == "__main__":
    sys.exit(main())
