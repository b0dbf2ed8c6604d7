#!/usr/bin/env bash
# CPU runs of benchmarks/NOTES.md "Is the early lag behind dense a bug?" (2 CPU cores, fp32,
# 2026-11-23, ~5 min dense / ~8 min each MoE): dense vs an 8-expert top-1 MoE of the same active
# size, softmax (the paper's router) and sigmoid + expert bias. From the repo root:
#   bash benchmarks/results/tiny-moe-vs-dense-cpu-2026-11-23/run.sh   # runs land in runs/
S=${STEPS:-800}
run() { name=$1; shift
  OMP_NUM_THREADS=2 megatron-moe-train --config configs/tiny-cpu.yaml name="$name" \
    logging.runs_dir=runs logging.wandb=false data.default_corpus_mb=30 \
    data.tokenizer_vocab_size=2048 model.vocab_size=2048 model.num_layers=4 model.seq_length=128 \
    train.micro_batch_size=32 train.global_batch_size=32 train.train_iters=$S train.lr=2e-3 train.min_lr=2e-4 \
    train.lr_warmup_iters=30 train.eval_interval=100 train.eval_iters=8 train.save_interval=100000 \
    train.save_final=false train.log_interval=50 "$@"
}
MOE="model.moe.num_experts=8 model.moe.top_k=1 model.moe.aux_loss_coeff=0.025 model.moe.z_loss_coeff=0"
run dense model.moe=null
run moe8 $MOE
run moe8-sigmoid $MOE model.moe.score_function=sigmoid model.moe.expert_bias=true
