"""Command-line tools around training runs (installed as ``megatron_moe.tools``).

- compare_runs.py (``megatron-moe-compare-runs``): tables and plots from run directories or W&B.
- find_micro_batch.py (``megatron-moe-find-micro-batch``): the largest micro-batch that fits.
- megatron_lm_args.py (``megatron-moe-megatron-lm-args``): Megatron-LM's pretrain_gpt.py command
  for a config, with our layer spec.
- prepare_data.py: the same as ``megatron-moe-prepare-data``.
"""
