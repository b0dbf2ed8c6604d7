#!/usr/bin/env bash
# One call on a lent GPU machine: set up, run the GPU tests, the layer benchmark and (optionally)
# short training runs; logs go to $OUT (or ./device_out). Usage:
#   bash benchmarks/device_run.sh [tests] [bench] [train] [quick]
# The machine has torch/triton/sentencepiece; megatron-core travels as a wheel in .whl/.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=" $* "
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
summary=()
if [[ $stages == *" tests "* ]]; then
  python3 -m pytest -q -x --timeout=900 tests/test_layer.py tests/test_grouped.py tests/test_blocksparse.py tests/test_metadata.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 30
  summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
fi
if [[ $stages == *" bench "* ]]; then
  if [[ $stages == *" quick "* ]]; then extra="--warmup-ms 25 --rep-ms 100"; else extra=""; fi
  python3 benchmarks/bench_layer.py $extra --out "$OUT/bench_layer.json" 2>&1 | tee "$OUT/bench.log" | tail -n 25
fi
if [[ $stages == *" train "* ]]; then
  for cfg in gpt-xs dmoe-xs; do
    python3 -m megatron_moe.train --config configs/$cfg.yaml ${TRAIN_OVERRIDES:-} logging.wandb=false \
      logging.runs_dir="$OUT/runs" 2>&1 | tee "$OUT/train_$cfg.log" | tail -n 5
  done
fi
printf '%s\n' "${summary[@]}"
