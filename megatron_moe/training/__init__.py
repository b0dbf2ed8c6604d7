"""The pretraining program: a megatron-core GPT (dense or with our MoE) from a YAML config.

    megatron-moe-train --config tiny-cpu            # a shipped config by name, or a path

- train.py: the program and its loop (``pretrain``, ``main``); run_config.py: the YAML config.
- checkpoint.py (atomic, exact resume, the config compared on resume), run_lock.py (one writer per
  run folder), stop_signals.py (SIGTERM / SIGUSR1: save and stop), metrics.py (metrics.jsonl, W&B),
  flops.py (MFU), distributed.py (the process group).
- precision.py (bf16 compute copies over fp32 masters), optimizer.py (AdamW, one fused pass),
  grad_reduce.py (data / expert-data parallel gradient reduction, clipping).
- data/: corpus, tokenizers, preparation (.bin/.idx), datasets (GPTDataset splits).
- fault_hooks.py: the faults the tests inject (never set in a normal run).

Needs ``pip install "megatron-moe[train]"`` (megatron-core, sentencepiece, pyyaml; wandb optional).
"""

from megatron_moe.megatron import require

require("megatron", "yaml", "numpy", "sentencepiece", "tqdm", extra="train")
