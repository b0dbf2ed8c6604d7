#!/usr/bin/env bash
# One GPU machine, one call: set up, run the GPU tests, the layer benchmark and (optionally)
# short training runs; logs go to $OUT (or ./device_out). Usage:
#   bash benchmarks/device_run.sh [tests] [faults] [profile] [bench] [train] [step] [router] [graphs] [norm] [tables] [mlm] [quick]
# TESTS (test files for 'tests'; default: every file with GPU cases), TEST_WORKERS (pytest-xdist's -n for 'tests' and 'faults'),
# PROFILE_ARGS (profile_layer.py's), BENCH_ARGS (bench_layer.py's), TRAIN_CONFIGS / TRAIN_OVERRIDES
# ('train'), STEP_RUNS / STEP_GB / STEP_STEPS (train_ab.sh's RUNS, global batch and steps for 'step'),
# GRAPH_RUNS, TABLE_CONFIGS ('tables'),
# MLM_STAGES (benchmarks/megatron_lm.py's --stages for 'mlm'; Megatron-LM's files in $MLM, default
# .mlm) narrow a stage. Set-up (optional wheels from .whl/, the kernels mapping):
# benchmarks/device_env.sh. The stages write to a temporary folder, packed at the end into
# $OUT/logs.tgz beside $OUT/summary.txt (the device tool brings back at most 8 files), again
# after each stage and every 60 s (a call cut short at its time limit still brings back the logs
# so far); PACK=0: the stages write to $OUT itself.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
if [[ ${PACK:-1} == 1 ]]; then DEST=$OUT; OUT=$(mktemp -d); fi  # the stages write here; packed at the end
stages=" $* "
source benchmarks/device_env.sh
write_env "$OUT/gpu.txt"; cat "$OUT/gpu.txt"
# the GPU suites in TEST_WORKERS processes (default 4) where pytest-xdist is there (a wheel of it and
# execnet in .whl/): their time is mostly each test's kernel compiles, one CPU core each
xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n "${TEST_WORKERS:-4}")
summary=()
pack() {  # what the stages wrote so far, into $DEST/logs.tgz (again after each stage: a call cut
  # short at its time limit still brings back the stages before)
  [[ ${PACK:-1} == 1 ]] && tar czf "$DEST/logs.tgz" -C "$OUT" . && printf '%s\n' "${summary[@]}" > "$DEST/summary.txt"
  return 0
}
add() { summary+=("$@"); pack; }
if [[ ${PACK:-1} == 1 ]]; then  # and every 60 s, so a stage cut short at the call's limit still brings back its logs
  ( trap 'exit 0' TERM  # a wait, unlike a foreground sleep, returns at once on the signal
    while true; do sleep 60 & wait $!
      tar czf /tmp/device_run_logs.tgz -C "$OUT" . 2>/dev/null && cp /tmp/device_run_logs.tgz "$DEST/logs.tgz"; done ) &
  packer=$!
  trap 'kill $packer 2>/dev/null' EXIT
fi
default_gpu_tests() {  # every test file with GPU cases (a gpu mark, a CUDA check or the device
  # fixture; test_faults.py is the 'faults' stage), and the distributed set-up's device selection
  grep -l -E "mark\.gpu|cuda\.is_available|def test_.*\bdevice\b" tests/*/test_*.py | grep -v test_faults.py | sort | tr '\n' ' '
  echo tests/training/test_distributed.py
}
if [[ $stages == *" tests "* ]]; then
  # one fixed tile config per kernel (MEGATRON_MOE_AUTOTUNE=0): correctness, not speed
  MEGATRON_MOE_AUTOTUNE=0 python3 -m pytest -q --timeout=900 -p no:cacheprovider "${xdist[@]}" --durations=10 \
    ${TESTS:-$(default_gpu_tests)} \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 30
  add "gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")"
fi
if [[ $stages == *" faults "* ]]; then
  # tests/training/test_faults.py on the GPU: its training runs use CUDA there, plus its GPU-only cases
  MEGATRON_MOE_AUTOTUNE=0 python3 -m pytest -q --timeout=600 -p no:cacheprovider "${xdist[@]}" --durations=10 \
    tests/training/test_faults.py \
    2>&1 | tee "$OUT/gpu_faults.log" | tail -n 25
  add "gpu faults: $(tail -n 1 "$OUT/gpu_faults.log")"
fi
if [[ $stages == *" profile "* ]]; then
  # per-kernel GPU time, host-bound check, tile sweep per grouped GEMM (benchmarks/profile_layer.py)
  python3 benchmarks/profile_layer.py ${PROFILE_ARGS:-} --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" | tail -n 60
fi
if [[ $stages == *" bench "* ]]; then
  if [[ $stages == *" quick "* ]]; then extra="--warmup-ms 25 --rep-ms 100"; else extra=""; fi
  python3 benchmarks/bench_layer.py $extra ${BENCH_ARGS:-} --out "$OUT/bench_layer.json" 2>&1 | tee "$OUT/bench.log" | tail -n 25
fi
if [[ $stages == *" train "* ]]; then
  # short bf16 runs (global batch 64 x 1024 tokens); checkpoints stay on the machine
  for cfg in ${TRAIN_CONFIGS:-gpt-xs dmoe-xs}; do
    python3 -m megatron_moe.training --config configs/$cfg.yaml logging.wandb=false logging.runs_dir=/tmp/runs \
      train.global_batch_size=64 train.train_iters=300 train.eval_interval=100 train.eval_iters=2 \
      train.save_interval=1000000 train.log_interval=20 ${TRAIN_OVERRIDES:-} 2>&1 | tee "$OUT/train_$cfg.log" | tail -n 4
    cp /tmp/runs/$cfg/metrics.jsonl "$OUT/metrics_$cfg.jsonl" 2>/dev/null
    add "train $cfg: $(python3 -c "import json,statistics as s;r=[json.loads(l) for l in open('/tmp/runs/$cfg/metrics.jsonl')];t=[x for x in r if x.get('tokens_per_s')][len(r)//10:];print('loss %.3f->%.3f val %s tok/s %.0f TFLOP/s %.1f MFU %s mem %.1fGB'%(r[0]['lm_loss'],r[-1]['lm_loss'],[x['val_loss'] for x in r if 'val_loss' in x][-1:],s.median(x['tokens_per_s'] for x in t),s.median(x['tflops_per_gpu'] for x in t),s.median(x['mfu'] for x in t),max(x['peak_mem_gb'] for x in t)))" 2>&1 | tail -1)"
  done
fi
if [[ $stages == *" router "* ]]; then
  # the fused router (issue #35): host calls per layer step, then the layer eager and graphed with
  # the fused router and without it (MEGATRON_MOE_FUSED_ROUTER=0), alternated in this one call
  python3 benchmarks/count_launches.py --device cuda --shape 16384,1024,4096,64,1 2>&1 | tee "$OUT/count.log"
  n=0
  for fused in 1 0 1 0; do
    n=$((n + 1))
    MEGATRON_MOE_FUSED_ROUTER=$fused python3 benchmarks/bench_layer.py --timing eager,graph \
      --configs ${ROUTER_CONFIGS:-paper-moe-m,fine-64e-top8,dmoe-small} --providers dense,triton_grouped \
      --out "$OUT/router_${n}_fused$fused.json" 2>&1 | tee -a "$OUT/router.log" | tail -n 8
  done
  add "router: $(tail -n 3 "$OUT/count.log" | tr '\n' ' ')"
fi
if [[ $stages == *" step "* ]]; then
  # the training step, eager against CUDA graphs and bf16 moments (issue #33): global batch 64 x 1024
  # (STEP_GB), micro-batch 32, medians of the second half of 40 steps (STEP_STEPS)
  # (benchmarks/train_ab.sh; its table is printed last)
  OUT="$OUT/step" MB=32 GB=${STEP_GB:-64} STEPS=${STEP_STEPS:-40} MEASURE_FROM=$(( ${STEP_STEPS:-40} / 2 )) \
    PROFILE_STEP=$(( ${STEP_STEPS:-40} * 3 / 4 )) RUNS="${STEP_RUNS:-gpt-xs:gpt-xs \
    gpt-xs-graph:gpt-xs:train.cuda_graphs=micro_batch dmoe-xs:dmoe-xs \
    dmoe-xs-graph:dmoe-xs:train.cuda_graphs=micro_batch dmoe-xs-bf16m:dmoe-xs:train.adam_moments_dtype=bf16}" \
    bash benchmarks/train_ab.sh 2>&1 | tee "$OUT/step.log" | tail -n 12
  add "step:" "$(cat "$OUT/step/train_ab.txt" 2>/dev/null)"
fi
if [[ $stages == *" graphs "* ]]; then
  # issue #33: the GPU test of graphed against eager training steps, then the step with CUDA
  # graphs: with bf16 moments, with torch's LayerNorm instead of ours (MEGATRON_MOE_FUSED_NORM=0),
  # and the Small pair at global batch 64
  MEGATRON_MOE_AUTOTUNE=0 python3 -m pytest -q --timeout=600 -p no:cacheprovider tests/training/test_cuda_graphs.py \
    2>&1 | tee "$OUT/gpu_graph_tests.log" | tail -n 15
  add "gpu graph tests: $(tail -n 1 "$OUT/gpu_graph_tests.log")"
  OUT="$OUT/graphs" MB=32 GB=64 STEPS=30 MEASURE_FROM=15 PROFILE_STEP=25 RUNS="${GRAPH_RUNS:-gpt-xs-graph:gpt-xs:train.cuda_graphs=micro_batch \
    dmoe-xs-graph:dmoe-xs:train.cuda_graphs=micro_batch \
    dmoe-xs-graph-bf16m:dmoe-xs:train.cuda_graphs=micro_batch,train.adam_moments_dtype=bf16 \
    gpt-xs-graph-torchnorm:gpt-xs:train.cuda_graphs=micro_batch,MEGATRON_MOE_FUSED_NORM=0 \
    dmoe-xs-graph-torchnorm:dmoe-xs:train.cuda_graphs=micro_batch,MEGATRON_MOE_FUSED_NORM=0 \
    gpt-small-graph:gpt-small:train.cuda_graphs=micro_batch dmoe-small-graph:dmoe-small:train.cuda_graphs=micro_batch}" \
    bash benchmarks/train_ab.sh 2>&1 | tee "$OUT/graphs.log" | tail -n 8
  add "graphs:" "$(cat "$OUT/graphs/train_ab.txt" 2>/dev/null)"
fi
if [[ $stages == *" norm "* ]]; then
  # issue #33: LayerNorm alone, ours against torch's, and its backward's launch-shape sweep
  python3 benchmarks/bench_layer_norm.py --out "$OUT/bench_layer_norm.json" 2>&1 | tee "$OUT/norm.log" | tail -n 8
  add "norm:" "$(tail -n 6 "$OUT/norm.log")"
fi
if [[ $stages == *" tables "* ]]; then
  # issue #35: tuning tables to ship in kernels/tuned/ for this GPU: each config's first step
  # tuned from nothing (shipped tables not read), then again from its table alone; the configs'
  # entries merged into $OUT/tables/<GPU>-triton<version>.json (the file to commit)
  for cfg in ${TABLE_CONFIGS:-dmoe-xs dmoe-small}; do
    python3 benchmarks/first_step.py --config "$cfg" --runs fresh,shipped --out "$OUT/tables/$cfg" 2>&1 | tail -n 5
  done
  python3 - "$OUT/tables" <<'EOF' | tee "$OUT/tables.log"
import json, sys, pathlib
root = pathlib.Path(sys.argv[1]); merged = {}
for f in sorted(root.glob("*/*-triton*.json")):
    data = json.loads(f.read_text())
    merged.setdefault(f.name, {"triton": data.get("triton"), "entries": {}})["entries"].update(data["entries"])
for name, data in merged.items():
    (root / name).write_text(json.dumps(data, indent=1, sort_keys=True))
    print(f"{name}: {len(data['entries'])} entries")
EOF
  add "tables: $(tr '\n' ' ' < "$OUT/tables.log")"
fi
if [[ $stages == *" mlm "* ]]; then
  # issue #32: Megatron-LM's pretrain_gpt.py with our layer (the README's commands, profiles);
  # its start-up runs make in megatron/core/datasets, where the wheel has no Makefile
  site=$(python3 -c "import megatron.core, os; print(os.path.dirname(megatron.core.__file__))")
  [[ -e $site/datasets/Makefile ]] || printf 'all:\n\t@true\n' > "$site/datasets/Makefile"
  MLM=${MLM:-.mlm} python3 benchmarks/megatron_lm.py --out "$OUT/mlm" \
    --stages "${MLM_STAGES:-readme,profile-dmoe,profile-dense-sdpa,dmoe-cefusion}" 2>&1 | tee "$OUT/mlm.log" | tail -n 16
  add "mlm:" "$(tail -n 12 "$OUT/mlm.log")"
fi
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
[[ -n ${packer:-} ]] && kill "$packer" 2>/dev/null && wait "$packer" 2>/dev/null  # before the last pack
pack
