#!/usr/bin/env bash
# Expert-parallel scaling on one host: the same model on 1 GPU (EP=1), 2 GPUs (EP=2) and 4 GPUs
# (EP=4), same micro-batch and micro-batches per GPU (weak scaling: the global batch grows with
# the GPUs). Prints tokens/s per GPU against one GPU and the GPU time in the token all-to-alls.
#
#   bash benchmarks/ep_scaling.sh                         # dmoe-small, grouped, 1/2/4 GPUs
#   GPUS="1 2" CFG=dmoe-xs STEPS=30 bash benchmarks/ep_scaling.sh
#
# Logs and metrics go to $OUT (default ./ep_out). Like device_run.sh it needs no pip install:
# megatron-core may travel as a wheel in .whl/, kernels/ is mapped to megatron_moe.kernels.
set -uo pipefail
OUT=${OUT:-$PWD/ep_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[[ -e megatron_moe/kernels ]] || ln -sfn ../kernels megatron_moe/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CFG=${CFG:-dmoe-small}; STEPS=${STEPS:-40}; MB=${MB:-8}; ACC=${ACC:-2}; IMPL=${IMPL:-grouped}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
for n in ${GPUS:-1 2 4}; do
  echo "== $CFG on $n GPU(s), expert_parallel_size=$n"
  timeout ${RUN_TIMEOUT:-300} torchrun --standalone --nnodes=1 --nproc-per-node="$n" -m megatron_moe.train \
    --config "configs/$CFG.yaml" logging.wandb=false logging.runs_dir=/tmp/ep$n \
    model.moe.expert_parallel_size="$n" model.moe.mlp_impl="$IMPL" \
    train.micro_batch_size="$MB" train.global_batch_size=$((MB * ACC * n)) train.train_iters="$STEPS" \
    train.lr_warmup_iters=$((STEPS / 4)) train.eval_interval=0 train.save_interval=1000000 train.save_final=false \
    train.log_interval=10 \
    > "$OUT/ep$n.log" 2>&1
  echo "   exit $? ($(tail -n 1 "$OUT/ep$n.log" | cut -c1-160))"
  cp "/tmp/ep$n/$CFG/metrics.jsonl" "$OUT/metrics_ep$n.jsonl" 2>/dev/null
done
python3 - "$OUT" "$STEPS" <<'EOF'
import json, os, statistics as st, sys
out, steps = sys.argv[1], int(sys.argv[2])
rows, base = [], None
for n in (1, 2, 4, 8):
    p = os.path.join(out, f"metrics_ep{n}.jsonl")
    if not os.path.exists(p):
        continue
    r = [json.loads(l) for l in open(p)]
    r = [x for x in r if x.get("tokens_per_s") and x["step"] > steps // 4]  # past compile / autotune
    if not r:
        continue
    tok = st.median(x["tokens_per_s"] for x in r) / n
    a2a = [x["a2a_ms"] for x in r if x.get("a2a_ms") is not None]
    row = dict(gpus=n, tokens_per_s_per_gpu=tok, step_time_s=st.median(x["step_time_s"] for x in r),
               a2a_ms=st.median(a2a) if a2a else 0.0,
               a2a_fraction=st.median(x.get("a2a_fraction", 0.0) for x in r),
               tflops_per_gpu=st.median(x.get("tflops_per_gpu") or 0.0 for x in r),
               peak_mem_gb=max(x.get("peak_mem_gb") or 0.0 for x in r))
    base = base or tok
    row["vs_1gpu"] = tok / base
    rows.append(row)
json.dump(rows, open(os.path.join(out, "ep_scaling.json"), "w"), indent=1)
print(f"{'GPUs':>4} {'tok/s/GPU':>10} {'vs 1 GPU':>8} {'s/step':>7} {'a2a ms':>7} {'a2a %':>6} {'TFLOP/s':>8} {'mem GB':>7}")
for r in rows:
    print(f"{r['gpus']:>4} {r['tokens_per_s_per_gpu']:>10,.0f} {r['vs_1gpu']:>8.2f} {r['step_time_s']:>7.3f} "
          f"{r['a2a_ms']:>7.1f} {100 * r['a2a_fraction']:>5.1f}% {r['tflops_per_gpu']:>8.1f} {r['peak_mem_gb']:>7.1f}")
EOF
