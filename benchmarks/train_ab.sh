#!/usr/bin/env bash
# Short single-GPU training runs side by side (A/B of a training option), each with a
# torch.profiler table of one step; a table of tokens/s, MFU and peak memory last.
#
#   RUNS="gpt-small-autocast:gpt-small:train.bf16_params=false gpt-small:gpt-small" \
#     bash benchmarks/train_ab.sh
#
# RUNS: "name:config[:overrides]" (overrides comma-separated), run one after another on GPU 0.
# STEPS (default 8), MB (micro-batch, default 64), GB (global batch, default MB), PROFILE_STEP
# (default 6; "mb=N" in a run's overrides sets its own micro-batch; an upper-case NAME=VALUE there
# is an environment variable of that run, e.g. MEGATRON_MOE_TMA_ADD=0; "from=N" its own MEASURE_FROM
# and "prof=N" its own PROFILE_STEP, with train.train_iters=N its own length: a long dropless run
# measured once its router has spread out beside a short dense one);
# GRAPHS: every run's train.cuda_graphs before its own overrides (default none: eager, so that an
# A/B names its CUDA-graph runs; auto for the trainer's default);
# medians over the steps after MEASURE_FROM (default 3); 'step1 s' is the first step's time
# (autotuning, CUDA-graph capture); 'max share' the median over those steps of the layers' mean
# busiest-expert share of tokens (1/experts when balanced); 'SM MHz' the median SM clock and 'max W' the highest power
# nvidia-smi sampled every 0.5 s while the GPU drew over 200 W (NAME.clocks.csv). Everything lands
# in $OUT/train_ab.tgz (logs, metrics.jsonl, profile tables, the profiled step's idle gaps from
# benchmarks/step_gaps.py, clocks) and $OUT/train_ab.txt (the table).
set -uo pipefail
OUT=${OUT:-$PWD/train_ab_out}; mkdir -p "$OUT"
W=$(mktemp -d)
source benchmarks/device_env.sh
STEPS=${STEPS:-8}; MB=${MB:-64}; GB=${GB:-$MB}; PROFILE_STEP=${PROFILE_STEP:-6}; MEASURE_FROM=${MEASURE_FROM:-3}
write_env "$W/env.txt"
for spec in ${RUNS:?RUNS is empty}; do
  IFS=: read -r name cfg own <<< "$spec"
  split_overrides "$own" "$MB"
  envs=("${env_extra[@]}"); cfg_over=(); echo "$MEASURE_FROM" > "$W/$name.from"; echo "$PROFILE_STEP" > "$W/$name.prof"
  for o in "${extra[@]}"; do
    if [[ $o == from=* ]]; then echo "${o#from=}" > "$W/$name.from"
    elif [[ $o == prof=* ]]; then echo "${o#prof=}" > "$W/$name.prof"
    else cfg_over+=("$o"); fi
  done
  extra=("${cfg_over[@]}")
  # the GPU's SM clock, power and temperature every 0.5 s while the run lasts (a clock that
  # falls in long steps shows as a lower median than in short ones)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -i "${CUDA_VISIBLE_DEVICES:-0}" -lms 500 > "$W/$name.clocks.csv" 2>/dev/null &
  smi=$!
  rm -rf /tmp/ab/"$name"  # a failed run leaves no metrics of an earlier run by the same name
  env "${envs[@]}" MEGATRON_MOE_PROFILE_STEP="$(cat "$W/$name.prof")" timeout "${RUN_TIMEOUT:-300}" python3 -m megatron_moe.training \
    --config "configs/$cfg.yaml" name="$name" logging.wandb=false logging.runs_dir=/tmp/ab \
    train.global_batch_size="$GB" train.micro_batch_size="$mb" train.train_iters="$STEPS" \
    train.lr_warmup_iters=2 train.eval_interval=0 train.save_interval=0 train.save_final=false \
    train.log_interval=1 data.default_corpus_mb=20 train.cuda_graphs="${GRAPHS:-none}" "${extra[@]}" > "$W/$name.log" 2>&1
  rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  echo "$name exit $rc ($(grep -m1 -E '^done|Error' "$W/$name.log" | cut -c1-120))"
  cp /tmp/ab/"$name"/metrics.jsonl "$W/$name.jsonl" 2>/dev/null
  cp /tmp/ab/"$name"/profile_step*_rank0.txt "$W/$name.profile.txt" 2>/dev/null
  # where the profiled step left the GPU idle (benchmarks/step_gaps.py)
  for j in /tmp/ab/"$name"/profile_step*_rank0.json; do
    [[ -e $j ]] && python3 benchmarks/step_gaps.py "$j" > "$W/$name.gaps.txt" 2>&1
  done
done
python3 - "$W" <<'EOF' | tee "$W/train_ab.txt"
import glob, json, os, statistics as st, sys
w = sys.argv[1]
def clocks(path):  # median SM MHz and highest power (W) over the samples of a busy GPU (power > 200 W)
    rows = []
    for line in open(path) if os.path.exists(path) else []:
        f = [x.strip() for x in line.split(",")]
        try:
            rows.append((float(f[1]), float(f[2])))
        except (IndexError, ValueError):
            continue
    busy = [r for r in rows if r[1] > 200] or rows
    return (f"{st.median(r[0] for r in busy):>6.0f}", f"{max(r[1] for r in busy):>5.0f}") if busy else ("     -", "    -")


def max_share(x):  # the layers' mean busiest-expert share at one step ("-" for a dense model)
    s = [v for k, v in x.items() if k.startswith("expert_load/") and k.endswith("/max_share")]
    return sum(s) / len(s) if s else None


print(f"{'run':<28} {'steps':>7} {'tok/s':>9} {'s/step':>7} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7} {'loss@1':>7} {'loss@end':>8} {'step1 s':>8} {'max share':>9} {'SM MHz':>6} {'max W':>5}")
for p in sorted(glob.glob(os.path.join(w, "*.jsonl"))):
    r = [json.loads(l) for l in open(p)]
    first, prof = (int(open(p[:-6] + ext).read()) for ext in (".from", ".prof"))
    t = [x for x in r if x["step"] > first and x["step"] != prof]  # the profiled step runs slower or r
    if not t:
        print(f"{os.path.basename(p)[:-6]:<28} no steps after {first} (of {len(r)})")
        continue
    sh = [m for m in map(max_share, t) if m is not None]
    share = f"{st.median(sh):>9.3f}" if sh else f"{'-':>9}"
    span = f"{first + 1}-{r[-1]['step']}"
    med = lambda k: st.median(x[k] if x.get(k) is not None else float("nan") for x in t)  # noqa: E731 (no MFU on a CPU)
    print(f"{os.path.basename(p)[:-6]:<28} {span:>7} {med('tokens_per_s'):>9,.0f} "
          f"{med('step_time_s'):>7.3f} {med('tflops_per_gpu'):>8.1f} {100 * med('mfu'):>5.1f}% {max((x.get('peak_mem_gb') or 0 for x in r), default=0):>7.1f} "
          f"{r[0]['lm_loss']:>7.4f} {r[-1]['lm_loss']:>8.4f} {r[0]['step_time_s']:>8.1f} {share} "
          f"{' '.join(clocks(p[:-6] + '.clocks.csv'))}")
EOF
cp "$W/train_ab.txt" "$OUT/"
tar czf "$OUT/train_ab.tgz" -C "$W" .
