#!/usr/bin/env bash
# Pretrain on one node: torchrun over all of its GPUs (or NPROC processes).
#
#   scripts/pretrain.sh dmoe-xs                       # every GPU of this node
#   NPROC=4 scripts/pretrain.sh gpt-xs train.lr=3e-4  # 4 GPUs, an override
#   scripts/pretrain.sh dmoe-xs --resume              # continue runs/dmoe-xs
#   NPROC=2 scripts/pretrain.sh tiny-cpu              # no GPU: 2 CPU processes (gloo)
#
# CONFIG: a shipped config's name or a YAML file. Everything after it goes to
# megatron-moe-train (key=value overrides, --resume, --print-config). NCCL_NVLS_ENABLE
# defaults to 0 (NVLink SHARP multicast off; set it to 1 where the fabric supports it).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit $([[ $# -lt 1 ]] && echo 2 || echo 0)
fi
CONFIG="$1"
shift

if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    [[ "$NPROC" -ge 1 ]] || NPROC=1
fi
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
if [[ -z "${OMP_NUM_THREADS:-}" && "$NPROC" -gt 1 ]]; then
    # Split the cores between the processes instead of oversubscribing them.
    export OMP_NUM_THREADS=$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))
fi

exec torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC" \
    -m megatron_moe.training --config "$CONFIG" "$@"
