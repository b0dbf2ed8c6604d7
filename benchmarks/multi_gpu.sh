#!/usr/bin/env bash
# Scaling on one 8-GPU host (the paper's setting): dropless MoE with expert parallelism, dense
# with data parallelism and the capacity-factor MoE, 1 to 8 GPUs, in "waves" of runs that share
# nothing (disjoint GPUs, each its own torchrun --standalone). Weak scaling: every run has the same
# micro-batch and micro-batches per GPU, so tokens/s per GPU compares directly.
#
#   bash benchmarks/multi_gpu.sh                  # all 7 waves (8 GPUs, ~7 minutes on H200s)
#   WAVES="2 3" STEPS=30 bash benchmarks/multi_gpu.sh
#   WAVES="1 2 3" WAVE_1="dmoe-small-ep1:dmoe-small:0:1" WAVE_2="dmoe-small-ep2:dmoe-small:0,1:2" \
#     WAVE_3="dmoe-small-ep4:dmoe-small:0,1,2,3:4" bash benchmarks/multi_gpu.sh     # 4 GPUs, EP 1/2/4
#
# A wave is one WAVE_n variable (defaults below, each can be set from outside): runs
# "name:config:gpus:ep[:overrides]" separated by spaces, started together on the GPUs listed
# (ep = expert_parallel_size, 0 = dense; overrides comma-separated, e.g.
# "dmoe-small-ep4-padded:dmoe-small:0,1,2,3:4:model.moe.a2a_splits=padded"; "mb=32" sets that
# run's micro-batch instead of MB; an upper-case NAME=value, e.g. MEGATRON_MOE_PEER_READS=per_peer,
# is set in that run's environment). A name is
# CONFIG-epN or CONFIG-dpN (N the GPUs), optionally followed by variant words (-padded,
# -sigmoid-padded); scaling is against the same CONFIG on the fewest GPUs whose variant words
# are among the run's (dmoe-small-ep4-sigmoid-padded against dmoe-small-ep1-sigmoid). Waves are
# skipped once DEADLINE seconds (default 560) are near, and a run still going at DEADLINE is
# stopped, so what ran still comes back. MOE_EXTRA: overrides for every MoE run. Medians over
# the steps after MEASURE_FROM (default STEPS/4); GRAPHS: every run's train.cuda_graphs (default
# none: runs on several GPUs are eager under the default 'auto', so the one-GPU runs are too);
# "a2a GB" the GB a rank received in a step's token exchanges (metrics.py's a2a_gb); "busiest" is the busiest expert's share of
# the tokens, averaged over MoE layers (1/E balanced, 1 collapsed), median over those steps;
# "rank imb" the busiest expert-parallel rank's tokens over the mean rank's (metrics.py).
# MEGATRON_MOE_PROFILE_STEP is set for PROFILE_RUN (torch.profiler over one step; the rank-0
# table lands in $OUT, and every rank's timeline side by side: tools/rank_timelines.py). Logs, metrics and scaling.json go to $OUT (default ./multi_gpu_out).
set -uo pipefail
START=$SECONDS  # DEADLINE counts from here: the data preparation too
OUT=${OUT:-$PWD/multi_gpu_out}; mkdir -p "$OUT"
source benchmarks/device_env.sh
STEPS=${STEPS:-30}; MB=${MB:-8}; ACC=${ACC:-2}; DEADLINE=${DEADLINE:-560}
MEASURE_FROM=${MEASURE_FROM:-$((STEPS / 4))}  # medians over the steps after this one (compile, autotune before)
PROFILE_RUN=${PROFILE_RUN:-dmoe-small-ep8}; PROFILE_STEP=${PROFILE_STEP:-$((STEPS - 5))}
WAVE_1=${WAVE_1:-"dmoe-small-ep1:dmoe-small:0:1 gpt-small-dp1:gpt-small:1:0 gpt-medium-dp1:gpt-medium:2:0 moe-small-ep1:moe-small:3:1 dmoe-small-ep4:dmoe-small:4,5,6,7:4"}
WAVE_2=${WAVE_2:-"dmoe-small-ep8:dmoe-small:0,1,2,3,4,5,6,7:8"}
WAVE_3=${WAVE_3:-"dmoe-medium-ep8:dmoe-medium:0,1,2,3,4,5,6,7:8"}
WAVE_4=${WAVE_4:-"moe-small-ep8:moe-small:0,1,2,3,4,5,6,7:8"}
WAVE_5=${WAVE_5:-"gpt-small-dp8:gpt-small:0,1,2,3,4,5,6,7:0"}
WAVE_6=${WAVE_6:-"gpt-medium-dp8:gpt-medium:0,1,2,3,4,5,6,7:0"}
WAVE_7=${WAVE_7:-"dmoe-small-ep2:dmoe-small:0,1:2 gpt-small-dp2:gpt-small:2,3:0 dmoe-medium-ep4:dmoe-medium:4,5,6,7:4"}
write_env "$OUT/env.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
# the default corpus and tokenizer once, before runs start side by side
python3 -m megatron_moe.training.data.prepare_cli --config configs/gpt-small.yaml > "$OUT/data_prep.log" 2>&1 || { tail "$OUT/data_prep.log"; exit 1; }

run_one() {  # name config gpus ep [overrides]
  local name=$1 cfg=$2 gpus=$3 ep=$4 own=${5:-} n mb extra env_extra
  n=$(tr ',' '\n' <<< "$gpus" | wc -l)
  split_overrides "$own" "$MB"  # mb=N: this run's micro-batch (global = N x ACC x GPUs)
  local envs=(CUDA_VISIBLE_DEVICES="$gpus" "${env_extra[@]}")
  [[ $ep -gt 0 ]] && extra=("model.moe.expert_parallel_size=$ep" ${MOE_EXTRA:-} "${extra[@]}")
  [[ $name == "$PROFILE_RUN" ]] && envs+=(MEGATRON_MOE_PROFILE_STEP="$PROFILE_STEP")
  # no run outlives DEADLINE, so the table below is printed within it (a run it cuts keeps its rows)
  local limit=$(( DEADLINE - (SECONDS - START) )); (( limit > ${RUN_TIMEOUT:-240} )) && limit=${RUN_TIMEOUT:-240}
  env "${envs[@]}" timeout "$limit" torchrun --standalone --nnodes=1 --nproc-per-node="$n" \
    -m megatron_moe.training --config "configs/$cfg.yaml" name="$name" logging.wandb=false \
    logging.runs_dir=/tmp/mg train.cuda_graphs="${GRAPHS:-none}" "${extra[@]}" \
    train.micro_batch_size="$mb" train.global_batch_size=$((mb * ACC * n)) train.train_iters="$STEPS" \
    train.lr_warmup_iters=$((STEPS / 4)) train.eval_interval=0 train.save_interval=0 train.save_final=false \
    train.log_interval=5 > "$OUT/$name.log" 2>&1
  local rc=$?
  cp "/tmp/mg/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  cat /tmp/mg/"$name"/profile_step*_rank0.txt > "$OUT/$name.profile.txt" 2>/dev/null || rm -f "$OUT/$name.profile.txt"
  gzip -c /tmp/mg/"$name"/profile_step*_rank0.json > "$OUT/$name.trace.json.gz" 2>/dev/null || rm -f "$OUT/$name.trace.json.gz"
  if [[ $name == "$PROFILE_RUN" && $n -gt 1 ]]; then  # every rank's GPU timeline of that step, side by side
    python3 tools/rank_timelines.py "/tmp/mg/$name" --step "$PROFILE_STEP" --group-size "$((ep > 0 ? ep : n))" \
      --merged "$OUT/$name.ranks.json" > "$OUT/$name.ranks.txt" 2>&1 && gzip -f "$OUT/$name.ranks.json"
  fi
  echo "   $name exit $rc ($(grep -m1 -E '^done|Error|error' "$OUT/$name.log" | cut -c1-150))"
}

for w in ${WAVES:-1 2 3 4 5 6 7}; do
  var="WAVE_$w"
  if (( SECONDS - START > DEADLINE - 75 )); then echo "== wave $w skipped (deadline)"; continue; fi
  echo "== wave $w at $((SECONDS - START)) s: ${!var}"
  for spec in ${!var}; do
    IFS=: read -r name cfg gpus ep own <<< "$spec"
    run_one "$name" "$cfg" "$gpus" "$ep" "$own" &
  done
  wait
done

python3 - "$OUT" "$MEASURE_FROM" <<'EOF'
import glob, json, os, re, statistics as st, sys
out, first = sys.argv[1], int(sys.argv[2])
def busiest(x):  # mean over MoE layers of the busiest expert's share of the tokens (0: dense)
    v = [val for k, val in x.items() if k.endswith("/max_share")]
    return sum(v) / len(v) if v else 0.0


rows = {}
for p in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
    name = os.path.basename(p)[:-6]
    r = [json.loads(l) for l in open(p)]
    r = [x for x in r if x.get("tokens_per_s") and x["step"] > first]  # past compile / autotune
    m = re.match(r"(.+?)-(ep|dp)(\d+)((?:-[A-Za-z0-9.]+)*)$", name)
    if not r or not m:
        continue
    n = int(m.group(3))
    a2a = [x["a2a_ms"] for x in r if x.get("a2a_ms") is not None]
    rows[name] = dict(config=m.group(1), variant=set(m.group(4).split("-")) - {""}, gpus=n, tokens_per_s_per_gpu=st.median(x["tokens_per_s"] for x in r) / n,
                      step_time_s=st.median(x["step_time_s"] for x in r), a2a_ms=st.median(a2a) if a2a else 0.0,
                      a2a_fraction=st.median(x.get("a2a_fraction", 0.0) for x in r),
                      a2a_gb=st.median(x.get("a2a_gb") or 0.0 for x in r),
                      tflops_per_gpu=st.median(x.get("tflops_per_gpu") or 0.0 for x in r),
                      mfu=st.median(x.get("mfu") or 0.0 for x in r),
                      peak_mem_gb=max(x.get("peak_mem_gb") or 0.0 for x in r),
                      busiest=st.median(busiest(x) for x in r),
                      rank_imbalance=(st.median(x["expert_load/ep_rank_imbalance"] for x in r)
                                      if all("expert_load/ep_rank_imbalance" in x for x in r) else None))
for name, row in rows.items():  # against the same config on the fewest GPUs, sharing most of its variant words
    base = min((x for x in rows.values() if x["config"] == row["config"] and x["variant"] <= row["variant"]),
               key=lambda x: (x["gpus"], -len(x["variant"])))
    row["vs"] = f"{row['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f} of {base['gpus']} GPU"
json.dump({k: dict(v, variant=sorted(v["variant"])) for k, v in rows.items()},
          open(os.path.join(out, "scaling.json"), "w"), indent=1)
print(f"{'run':<30} {'GPUs':>4} {'tok/s/GPU':>10} {'scaling':>12} {'s/step':>7} {'a2a ms':>7} {'a2a %':>6} {'a2a GB':>7} {'TFLOP/s':>8} {'MFU':>5} {'mem GB':>7} {'busiest':>7} {'rank imb':>8}")
for name, r in sorted(rows.items(), key=lambda kv: (kv[1]["config"], kv[1]["gpus"])):
    print(f"{name:<30} {r['gpus']:>4} {r['tokens_per_s_per_gpu']:>10,.0f} {r['vs']:>12} {r['step_time_s']:>7.3f} "
          f"{r['a2a_ms']:>7.1f} {100 * r['a2a_fraction']:>5.1f}% {r['a2a_gb']:>7.2f} {r['tflops_per_gpu']:>8.1f} {100 * r['mfu']:>4.1f}% {r['peak_mem_gb']:>7.1f} {r['busiest']:>7.3f} {'-' if r['rank_imbalance'] is None else format(r['rank_imbalance'], '.2f'):>8}")
EOF
# everything in one archive, $OUT/multi_gpu.tgz, to copy back from a remote machine: TARBALL=1
[[ "${TARBALL:-0}" == 1 ]] && tar czf "/tmp/multi_gpu.tgz" -C "$OUT" . && mv /tmp/multi_gpu.tgz "$OUT/"
