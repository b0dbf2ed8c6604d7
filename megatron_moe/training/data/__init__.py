"""Training data, one module per job: text / JSONL -> tokenizer -> megatron-core .bin/.idx ->
GPTDataset splits.

    from megatron_moe.training.data import DataConfig, prepare_data, build_datasets
    cfg = DataConfig()                            # default corpus: Python stdlib sources
    prepared = prepare_data(cfg)                  # cached under cfg.cache_dir, keyed by inputs
    train, valid, test = build_datasets(cfg, prepared, seq_length=256, seed=1234,
                                        num_samples=(4096, 512, 64), model_vocab_size=8192)

The same from the shell: ``megatron-moe-prepare-data`` (prepare_cli.py).

- config.py: ``DataConfig``, the ``data:`` section of a run config.
- corpus.py: the input files (or the default corpus) as documents, cut into sequences.
- tokenizers.py: sentencepiece (trained on the corpus, or given) and GPT-2 byte-level BPE.
- preparation.py: tokenized .bin/.idx, cached by input; checks of an existing prefix.
- datasets.py: megatron-core ``GPTDataset`` train/valid/test splits over a prefix, and the
  sampler that deals each rank its micro-batches.
"""
from .config import TOKENIZER_TYPES, DataConfig
from .datasets import MicroBatchSampler, build_datasets, micro_batch_loader, split_tokens
from .preparation import PreparedData, export_prefix, prepare_data

__all__ = ["DataConfig", "TOKENIZER_TYPES", "PreparedData", "prepare_data", "export_prefix",
           "build_datasets", "split_tokens", "MicroBatchSampler", "micro_batch_loader"]
