#!/usr/bin/env bash
# SonicMoE beside our layer at the fine-grained SwiGLU shapes (issue #35), on a GPU machine with no
# package index. Usage, from the repository root:
#   bash benchmarks/sonicmoe.sh bundle             # here, with an index: SonicMoE's wheels unpacked into
#                                                  #   one xz tar, .sonic/site.tar.xz (~53 MB; ignore .sonic/)
#   bash benchmarks/sonicmoe.sh compile [CONFIGS]  # on the GPU: SonicMoE's GEMMs compiled (at the first config)
#   bash benchmarks/sonicmoe.sh time [CONFIGS]     # on the GPU: SonicMoE, dense and ours, eager, one process, twice;
#                                                  #   then both steps' kernels in launch order (ORDER=0: not)
# CONFIGS: bench_layer.py's, default sonic-1536,qwen3-30b-a3b,olmoe,sonic-4096. The device tool's calls
# carry .sonic (run(..., carry=[".sonic"])). QuACK compiles every candidate of every GEMM kind on its
# first call: 468 and 495 s at sonic-1536 on an H200 with 16 workers (2026-12-06), most of a call, so
# `compile` and `time` are two calls on one warm machine. Its cache goes to QUACK_CACHE_DIR (default
# /tmp/quack_cache, outside the repository: on 2026-12-06 a cache in an ignored folder of the repository
# was gone by the next call on the same warm machine); each stage prints what it finds there (cache.txt),
# and `time` stops at once when it finds no compiled objects (FORCE=1: compiles them within the call). Its tuning
# results (small JSON files: the tile each GEMM chose) come back as $OUT/quack-tuning.tgz.
# benchmarks/results/sonicmoe-h200-2026-11-29/README.md has the versions and the measurements so far.
set -uo pipefail
stage=${1:?usage: bash benchmarks/sonicmoe.sh bundle|compile|time [CONFIGS]}
configs=${2:-sonic-1536,qwen3-30b-a3b,olmoe,sonic-4096}
[[ $stage == @(bundle|compile|time) ]] || { echo "unknown stage '$stage': bundle, compile or time"; exit 1; }
bundle=.sonic/site.tar.xz
# what the bundle holds (sonic-moe pins torch <= 2.9.1 and Python >= 3.12: installed without its
# dependencies it runs on torch 2.11)
wheels=(sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-cu13==4.4.2
        apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops)

if [[ $stage == bundle ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$tmp/whl" "${wheels[@]}" \
    || exit 1
  python3 -m pip install -q --no-deps --no-compile --ignore-requires-python --target "$tmp/site" \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --only-binary=:all: "$tmp"/whl/*.whl \
    || exit 1
  mkdir -p .sonic && XZ_OPT="-9 -T0" tar cJf "$bundle" -C "$tmp" site && rm -rf "$tmp"
  grep -qx '/.sonic/' .git/info/exclude 2>/dev/null || echo "note: add /.sonic/ to .git/info/exclude"
  ls -la "$bundle"; exit 0
fi

[[ -f $bundle ]] || { echo "$bundle is missing: run 'bash benchmarks/sonicmoe.sh bundle' where pip has an index, and carry .sonic"; exit 1; }
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/tmp/quack_cache} QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=$(nproc)
mkdir -p "$QUACK_CACHE_DIR"
objects() { find "$QUACK_CACHE_DIR" -name '*.o' | wc -l; }
cache_state() { echo "$1: host $(hostname), repo $PWD, $QUACK_CACHE_DIR holds $(objects) objects and" \
  "$(find "$QUACK_CACHE_DIR" -name '*.autotune.json' | wc -l) tuning results" | tee -a "$OUT/cache.txt"; }
cache_state "before"
# `time` without compile's objects would spend ~500 s of its call compiling and run out of time
# before the comparison (as on 2026-12-06): it stops here instead, unless FORCE=1
if [[ $stage == time && ${FORCE:-0} != 1 && $(objects) == 0 ]]; then
  echo "time: $QUACK_CACHE_DIR holds no compiled GEMMs (this machine did not keep the compile stage's cache):" \
    "nothing timed; run 'compile' first on this machine, or FORCE=1 to compile within this call (~500 s)"
  exit 2
fi
source benchmarks/device_env.sh
write_env "$OUT/env.txt"
site=/tmp/sonic_site
[[ -d $site/sonicmoe ]] || { mkdir -p $site && tar xJf "$bundle" -C $site --strip-components=1; } || exit 1
# the .pth of nvidia-cutlass-dsl is not read from a --target folder: its path goes on PYTHONPATH
export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
python3 -c "import sonicmoe, quack, cutlass; print('SonicMoE', sonicmoe.__file__, 'CuTe DSL', cutlass.__version__)" || exit 1
echo "bundle: ${wheels[*]}" >> "$OUT/env.txt"
pack_tuning() { (cd "$QUACK_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar czf "$OUT/quack-tuning.tgz" --null -T -); }

case $stage in
  compile)
    t0=$(date +%s)
    # SonicMoE alone at the first shape: every candidate of every GEMM kind compiles there (the
    # objects do not depend on the shape); the other shapes only tune, 5-33 s each, in `time`
    python3 benchmarks/bench_layer.py --configs "${configs%%,*}" --providers sonicmoe --timing eager --warmup-ms 10 \
      --rep-ms 20 --out "$OUT/sonicmoe-compile.json" 2>&1 | grep -v "leaked\|nanobind"
    echo "compile stage: $(( $(date +%s) - t0 )) s"; cache_state "after" ;;
  time)
    for r in a b; do
      echo "== round $r"
      python3 benchmarks/bench_layer.py --configs "$configs" --providers sonicmoe,dense,triton_grouped --timing eager \
        --warmup-ms 25 --rep-ms 150 --out "$OUT/layer-$r.json" 2>&1 | grep -v "leaked\|nanobind"
    done 2>&1 | tee "$OUT/layer.log"
    # one step's kernels in launch order, each the median of 5 profiled steps: the six GEMMs one by one
    [[ ${ORDER:-1} == 1 ]] && python3 benchmarks/profile_layer.py --order --configs "$configs" \
      --providers sonicmoe,triton_grouped 2>&1 | grep -v "leaked\|nanobind" | tee "$OUT/kernel_order.txt"
    cache_state "after" ;;
esac
pack_tuning
