#!/usr/bin/env bash
# The reproduction's runs side by side on one node, one GPU each (they are independent
# single-GPU runs): each argument SIZE:RUN is one scripts/reproduce.sh run; the i-th goes to
# GPU i mod NGPUS, each GPU works through its runs in order. Then the table and plots per size.
#
#   scripts/reproduce_parallel.sh xs:gpt-xs xs:dmoe-xs xs:moe-xs-cf1 xs:moe-xs-cf1.5 xs:moe-xs-cf2 \
#       small:gpt-small small:dmoe-small small:moe-small-cf1        # 8 GPUs, one wave
#   TOKENS_XS=31457280 TOKENS_SMALL=15728640 MB_START=16 scripts/reproduce_parallel.sh ...
#
# Environment: NGPUS (default: nvidia-smi's count) or GPUS (indices, e.g. GPUS="4 5 6 7");
# TOKENS_<SIZE> (else TOKENS, else reproduce.sh's default); everything reproduce.sh reads
# (MB_START, MICRO_BATCH_<NAME>, TAG, EVAL_ITERS ...). Overrides after "--" go to every run:
#   scripts/reproduce_parallel.sh xs:gpt-xs -- logging.wandb=false
# Logs: RUNS_DIR/logs/NAME.log as with reproduce.sh; each run's console output in
# ${TMPDIR:-/tmp}/reproduce-SIZE-RUN.out. Runs sharing a GPU slow each other down: give each its
# own (at most NGPUS arguments) when throughput is the point.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
SPECS=()
while [[ $# -gt 0 && "$1" != "--" ]]; do SPECS+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
[[ ${#SPECS[@]} -gt 0 ]] || { echo "reproduce_parallel.sh: no runs given: expected SIZE:RUN arguments, e.g. xs:gpt-xs (see the header)" >&2; exit 2; }
for s in "${SPECS[@]}"; do
    [[ "$s" =~ ^(xs|small|medium):[a-z0-9.-]+$ ]] || {
        echo "reproduce_parallel.sh: run '$s' is invalid: expected SIZE:RUN with SIZE xs, small or medium, e.g. small:dmoe-small" >&2; exit 2; }
done
if [[ -z "${GPUS:-}" ]]; then
    NGPUS="${NGPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}"
    [[ "$NGPUS" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce_parallel.sh: NGPUS='$NGPUS' is invalid: expected the number of GPUs (no nvidia-smi here?)" >&2; exit 2; }
    GPUS="$(seq -s ' ' 0 $((NGPUS - 1)))"
fi
read -r -a GPU_IDS <<< "$GPUS"
NGPUS=${#GPU_IDS[@]}
for g in "${GPU_IDS[@]}"; do
    [[ "$g" =~ ^[0-9]+$ ]] || { echo "reproduce_parallel.sh: GPUS='$GPUS' is invalid: expected GPU indices, e.g. GPUS='4 5 6 7'" >&2; exit 2; }
done
# the config's corpus and tokenizer once, before runs start side by side (with data.* overrides
# each run builds its own: the cache is renamed into place complete, so that is only slower)
[[ "${DRY_RUN:-0}" == 1 ]] || "${PYTHON:-python}" -m megatron_moe.training.data.prepare_cli --config "configs/gpt-${SPECS[0]%%:*}.yaml" >/dev/null

LOG_DIR="${TMPDIR:-/tmp}"  # each run's console output: $LOG_DIR/reproduce-SIZE-RUN.out
tokens_for() { local v="TOKENS_${1^^}"; echo "${!v:-${TOKENS:-}}"; }
pids=()
for ((g = 0; g < NGPUS && g < ${#SPECS[@]}; g++)); do
    (
        for ((i = g; i < ${#SPECS[@]}; i += NGPUS)); do
            size="${SPECS[$i]%%:*}" name="${SPECS[$i]#*:}"
            tok="$(tokens_for "$size")"
            echo "== GPU ${GPU_IDS[$g]}: $size $name"
            env CUDA_VISIBLE_DEVICES=${GPU_IDS[$g]} RUNS="$name" ${tok:+TOKENS=$tok} NO_COMPARE=1 \
                bash scripts/reproduce.sh "$size" "$@" > "$LOG_DIR/reproduce-$size-$name.out" 2>&1 \
                || echo "== GPU ${GPU_IDS[$g]}: $size $name failed (last lines of $LOG_DIR/reproduce-$size-$name.out):" \
                        "$(tail -n 3 "$LOG_DIR/reproduce-$size-$name.out")"
        done
    ) &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for size in $(printf '%s\n' "${SPECS[@]%%:*}" | sort -u); do
    tok="$(tokens_for "$size")"
    runs=$(printf '%s\n' "${SPECS[@]}" | sed -n "s/^$size://p" | tr '\n' ' ')
    echo "== $size: table and plots"
    env COMPARE_ONLY=1 RUNS="$runs" ${tok:+TOKENS=$tok} bash scripts/reproduce.sh "$size" "$@" | tail -n 30 || status=1
done
exit $status
