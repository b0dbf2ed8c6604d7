"""The Megatron-LM command that trains a config's model with our layer: pretrain_gpt.py's flags.

    megatron-moe-megatron-lm-args dmoe-xs                          # a shell command to edit and run
    megatron-moe-megatron-lm-args dmoe-small train.micro_batch_size=8 --nproc 8
    megatron-moe-megatron-lm-args my-configs/dmoe-long.yaml --list # the flags alone, one per line
    megatron-moe-megatron-lm-args dmoe-xs --nproc 1 --save ckpt > run.sh  # run.sh saves to and resumes from ckpt/

A config is a shipped config's name or a YAML file; key=value overrides follow it. The command
sets ``MEGATRON_MOE_CONFIG`` (and ``MEGATRON_MOE_OVERRIDES``, the model's overrides) for our
settings that have no Megatron flag (``mlp_impl``, ...), and gives every setting that has one as
the flag, from the same values, so both sides agree (megatron_moe/megatron/flags.py checks that
they do). What maps:

- model: layers, hidden, heads, ffn, sequence length (= max positions), position embeddings,
  swiglu, init std, untied embeddings, no dropout (our model has none);
- model.moe: ``--num-experts`` ... ``--expert-model-parallel-size`` (docs/megatron.md's table);
- train: batch sizes, iterations, learning-rate schedule (warm-up, cosine decay, min lr), AdamW,
  clipping, seed, bf16, evaluation, checkpoint and log intervals, exit interval; ``--save DIR``
  adds Megatron's ``--save DIR --load DIR`` (a run resumes from DIR's latest checkpoint, or starts
  anew when there is none);
- data: ``data.data_prefix`` with its tokenizer as ``--data-path`` and the tokenizer flags; with
  ``data.paths`` (prepared by our program) or the default corpus, ``--mock-data`` stands in, to
  be replaced by your data's flags;
- the flags our spec needs without Transformer Engine or Apex (``--transformer-impl local``,
  ``--no-persist-layer-norm``, ``--no-masked-softmax-fusion``, ``--no-gradient-accumulation-fusion``).

Not mapped (no Megatron-LM flag, or nothing to map): W&B (Megatron-LM's ``--wandb-project``),
our fused optimizer and bf16-parameter options (Megatron-LM has its own), ``train.adam_moments_dtype``
(Megatron-LM's ``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``
needs Transformer Engine's FusedAdam), ``train.cuda_graphs``, ``train.deterministic``
(``--deterministic-mode`` needs NCCL_ALGO set).
"""
from __future__ import annotations

import argparse
import shlex
import sys

SPEC = ["--spec", "megatron_moe.megatron.spec", "layer_spec"]
NO_TE_NO_APEX = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
                 "--no-gradient-accumulation-fusion"]


def _num(v) -> str:
    """A flag or value as a command-line word (floats as repr: their exact value)."""
    return repr(v) if isinstance(v, float) else str(v)


def model_flags(model) -> list[str]:
    """The model's sizes and shape (ModelConfig) as Megatron-LM flags."""
    f = ["--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
         "--num-attention-heads", model.num_attention_heads, "--ffn-hidden-size", model.ffn_hidden_size,
         "--seq-length", model.seq_length, "--max-position-embeddings", model.seq_length,
         "--position-embedding-type", model.position_embedding_type, "--init-method-std", model.init_method_std,
         "--attention-dropout", 0.0, "--hidden-dropout", 0.0]
    if model.activation == "swiglu":
        f.append("--swiglu")
    if not model.share_embeddings_and_output_weights:
        f.append("--untie-embeddings-and-output-weights")
    return [_num(x) for x in f]


def moe_flags(moe) -> list[str]:
    """model.moe (a MoESection) as Megatron's MoE flags: the inverse of flags.py's table."""
    if moe.score_function == "sigmoid" and moe.normalize_top_k != (moe.top_k > 1):
        raise ValueError(
            f"model.moe.normalize_top_k={moe.normalize_top_k} with score_function='sigmoid' and top_k="
            f"{moe.top_k} has no Megatron-LM flags (Megatron renormalises sigmoid weights exactly when "
            "top_k > 1): use normalize_top_k=" + str(moe.top_k > 1).lower())
    f = ["--num-experts", moe.num_experts, "--moe-router-topk", moe.top_k,
         "--moe-router-score-function", moe.score_function,
         "--moe-aux-loss-coeff", moe.aux_loss_coeff]
    if moe.aux_loss_coeff == 0:
        f += ["--moe-router-load-balancing-type", "none"]
    if moe.score_function == "softmax" and not moe.normalize_top_k:
        f.append("--moe-router-pre-softmax")
    if moe.z_loss_coeff:
        f += ["--moe-z-loss-coeff", moe.z_loss_coeff]
    if moe.ffn_hidden_size is not None:
        f += ["--moe-ffn-hidden-size", moe.ffn_hidden_size]
    if moe.moe_layer_freq != 1:
        f += ["--moe-layer-freq", moe.moe_layer_freq]
    if moe.jitter_eps:
        f += ["--moe-input-jitter-eps", moe.jitter_eps]
    if moe.expert_bias:
        f += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", moe.expert_bias_update_rate]
    if moe.shared_expert_ffn_hidden_size:
        f += ["--moe-shared-expert-intermediate-size", moe.shared_expert_ffn_hidden_size]
    if moe.expert_parallel_size != 1:
        f += ["--expert-model-parallel-size", moe.expert_parallel_size]
    return [_num(x) for x in f]


def train_flags(tc) -> list[str]:
    """The train section (TrainConfig) as Megatron-LM flags."""
    f = ["--micro-batch-size", tc.micro_batch_size, "--global-batch-size", tc.global_batch_size,
         "--train-iters", tc.train_iters, "--lr", tc.lr, "--min-lr", tc.min_lr,
         "--lr-decay-style", "cosine", "--lr-warmup-iters", tc.lr_warmup_iters,
         "--lr-decay-iters", tc.lr_decay_iters if tc.lr_decay_iters is not None else tc.train_iters,
         "--weight-decay", tc.weight_decay, "--adam-beta1", tc.adam_beta1, "--adam-beta2", tc.adam_beta2,
         "--adam-eps", tc.adam_eps, "--clip-grad", tc.clip_grad, "--seed", tc.seed,
         "--eval-iters", tc.eval_iters if tc.eval_interval else 0,
         "--eval-interval", tc.eval_interval or tc.train_iters,
         "--save-interval", tc.save_interval or tc.train_iters, "--log-interval", tc.log_interval]
    if tc.bf16:
        f.append("--bf16")
    if tc.exit_interval:
        f += ["--exit-interval", tc.exit_interval]
    return [_num(x) for x in f]


def data_flags(data, vocab_size: int) -> tuple[list[str], str | None]:
    """The data and tokenizer flags, and a note when they are a stand-in (--mock-data)."""
    if data.data_prefix is None:
        return (["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size - 1)],
                "--mock-data stands in for the corpus: replace it with --data-path PREFIX and your "
                "tokenizer's flags (NullTokenizer's --vocab-size is one below the model's: it adds an "
                "end-of-document token)")
    f = ["--data-path", data.data_prefix, "--split", data.split]
    if data.tokenizer_type == "gpt2bpe":
        f += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data.vocab_file, "--merge-file",
              data.merges_file]
    elif data.tokenizer_model is not None:
        f += ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", data.tokenizer_model]
    else:
        return f, ("data.tokenizer_model is not set: add your tokenizer's flags (the data at "
                   f"{data.data_prefix} was made with a tokenizer this config does not name)")
    return f, None


def megatron_lm_command(cfg, config: str, overrides: list[str] = (), nproc: int = 8, save: str | None = None
                        ) -> tuple[list[str], dict, list[str]]:
    """(the flags, the environment, notes) that train ``cfg`` (a RunConfig: ``config`` with
    ``overrides``) under pretrain_gpt.py. The environment names the config and its model
    overrides, for the settings without a flag; the flags state the rest, from the same values."""
    notes = []
    flags = SPEC + NO_TE_NO_APEX + model_flags(cfg.model)
    env = {"MEGATRON_MOE_CONFIG": config}
    model_overrides = [o for o in overrides if o.startswith("model.")]
    if model_overrides:
        env["MEGATRON_MOE_OVERRIDES"] = " ".join(model_overrides)
    if cfg.model.moe is not None:
        flags += moe_flags(cfg.model.moe)
    flags += train_flags(cfg.train)
    if save:
        flags += ["--save", save, "--load", save]
    data, note = data_flags(cfg.data, cfg.model.vocab_size)
    flags += data
    if note:
        notes.append(note)
    if cfg.train.global_batch_size % (cfg.train.micro_batch_size * nproc):
        notes.append(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
                     f"micro-batch x data-parallel size ({cfg.train.micro_batch_size} x {nproc})")
    return flags, env, notes


def _shell(flags: list[str], env: dict, nproc: int) -> str:
    lines = [" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\"] if env else []
    lines.append(f"torchrun --nproc-per-node {nproc} pretrain_gpt.py \\")
    groups, current = [], []
    for tok in flags:
        if tok.startswith("--") and current and len(" ".join(current)) > 60:
            groups.append(current)
            current = []
        current.append(shlex.quote(tok))
    groups.append(current)
    cont = [" \\"] * (len(groups) - 1) + [""]
    lines += ["    " + " ".join(g) + c for g, c in zip(groups, cont)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="examples:\n" + __doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="config name (e.g. dmoe-xs) or a YAML file")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ap.add_argument("--nproc", type=int, default=8, help="GPUs per node in the printed torchrun line (default 8)")
    ap.add_argument("--list", action="store_true", help="the flags alone, one per line (with their values)")
    ap.add_argument("--save", metavar="DIR", help="checkpoints: Megatron's --save DIR --load DIR (resumes from DIR)")
    args = ap.parse_intermixed_args(argv)
    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc} is invalid: expected an int >= 1")
    from megatron_moe.training.run_config import ConfigError, load_config

    from megatron_moe.megatron.yaml_config import find_config

    try:
        path = find_config(args.config)
        config = args.config if path.parent.name == "configs" and path.stem == args.config else str(path.resolve())
        cfg = load_config(path, args.overrides)
        flags, env, notes = megatron_lm_command(cfg, config, args.overrides, args.nproc, args.save)
    except (ConfigError, ValueError) as e:
        print(f"megatron-moe-megatron-lm-args: error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for k, v in env.items():
            print(f"{k}={v}")
        print("\n".join(flags))
    else:
        print(_shell(flags, env, args.nproc))
    for note in notes:
        print(f"# note: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
