#!/usr/bin/env bash
# Reproduce MegaBlocks' end-to-end comparison at one size: dense vs dropless MoE vs
# capacity-factor MoE (capacity 1, 1.5, 2), same data, same tokens, each at the largest
# micro-batch that fits (tools/find_micro_batch.py), global batch as configured.
#
#   scripts/reproduce.sh xs                                   # 5 runs on one GPU, then the table
#   scripts/reproduce.sh small 'data.paths=[/data/pile/00.jsonl]'   # overrides go to every run
#   TOKENS=62914560 scripts/reproduce.sh xs                   # 120 steps of 512 x 1024 tokens
#   DRY_RUN=1 scripts/reproduce.sh xs                         # print the commands only
#   MICRO_BATCH_GPT_XS=64 MICRO_BATCH_DMOE_XS=32 scripts/reproduce.sh xs   # skip those searches
#   NPROC=8 EP=8 scripts/reproduce.sh medium                  # torchrun (scripts/pretrain.sh)
#   NPROC=8 EP=8 DMOE_OVERRIDES=model.moe.a2a_splits=symmetric scripts/reproduce.sh xs   # the paper's 8 GPUs
#
# SIZE is xs, small or medium (dmoe-/moe-medium need ~208 GB for weights + AdamW: use NPROC>=4
# and EP, expert parallelism for the MoE runs only). Environment:
#   TOKENS       training tokens per run (default 31457280 = 60 steps of 512 x 1024, a few
#                minutes per run on one H100); steps = TOKENS / (global batch x seq length)
#   WARMUP       warm-up steps (default steps/10); the LR decays (cosine) to the end
#   EVAL_INTERVAL / EVAL_ITERS   evaluate every N steps (default steps/6) on M global batches (2)
#   NPROC        GPUs (default 1: python -m megatron_moe.training; >1: scripts/pretrain.sh)
#   EP           model.moe.expert_parallel_size for the MoE runs (default: unset)
#   DMOE_OVERRIDES  key=value overrides (space-separated) for the dropless runs only, e.g. with EP
#                on one node "model.moe.a2a_splits=symmetric" (the fastest exchange measured; CUDA
#                graphs then hold the steps; the capacity-factor runs keep the host exchange)
#   MICRO_BATCH_<NAME>   micro-batch for run NAME, upper-cased, '-'/'.' -> '_' (e.g.
#                MICRO_BATCH_MOE_XS_CF1_5); else the search's saved answer, else a search
#   MB_START     first micro-batch the search tries (default: the config's micro_batch_size)
#   RUNS         subset of run names (default: all 5); RUNS_DIR (default runs/repro-SIZE)
#   RESULTS      default benchmarks/results/repro-SIZE: micro_batch/*.json, env.txt,
#                runs/NAME/{metrics.jsonl.gz,config.yaml} (committed; compare_runs reads the .gz),
#                table.md/json, compare.txt, plots/. The console logs stay out of it:
#                RUNS_DIR/logs/NAME.log and NAME.find.log
#   KEEP_CHECKPOINTS=1 saves each run's final checkpoint in RUNS_DIR/NAME/checkpoints
#                (default: none is written, train.save_final=false: a dmoe-small checkpoint is
#                ~44 GB); FORCE=1 reruns runs already done
#   TAG          a variant's name: runs/repro-SIZE-TAG, benchmarks/results/repro-SIZE-TAG, W&B group
#                repro-SIZE-TAG (e.g. TAG=gb64 with train.global_batch_size=64)
#   TARGET_LOSS  the table's time-to-target loss: a number, or "baseline" for gpt-SIZE's final
#                validation loss (the paper's "time to reach dense's loss"); default: the worst final
#   NO_COMPARE=1 trains only; COMPARE_ONLY=1 only rebuilds the table and plots from RESULTS
#                (scripts/reproduce_parallel.sh uses both)
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    usage
    exit $([[ $# -lt 1 ]] && echo 2 || echo 0)
fi
SIZE="$1"
shift
case "$SIZE" in
    xs|small|medium) ;;
    *) echo "reproduce.sh: SIZE '$SIZE' is invalid: expected xs, small or medium (see --help)" >&2; exit 2 ;;
esac
for o in "$@"; do
    [[ "$o" == *=* ]] || { echo "reproduce.sh: override '$o' is invalid: expected key=value, e.g. train.lr=3e-4" >&2; exit 2; }
done
read -r -a DMOE_OVR <<< "${DMOE_OVERRIDES:-}"
for o in "${DMOE_OVR[@]}"; do
    [[ "$o" == *=* ]] || { echo "reproduce.sh: DMOE_OVERRIDES entry '$o' is invalid: expected key=value, e.g. model.moe.a2a_splits=symmetric" >&2; exit 2; }
done

REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"
NPROC="${NPROC:-1}"
TOKENS="${TOKENS:-31457280}"
RUNS_DIR="${RUNS_DIR:-runs/repro-$SIZE${TAG:+-$TAG}}"
RESULTS="${RESULTS:-benchmarks/results/repro-$SIZE${TAG:+-$TAG}}"
GROUP="repro-$SIZE${TAG:+-$TAG}"
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: NPROC='$NPROC' is invalid: expected an int >= 1 (GPUs)" >&2; exit 2; }
[[ "$TOKENS" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: TOKENS='$TOKENS' is invalid: expected a positive integer (training tokens per run)" >&2; exit 2; }
[[ -z "${EP:-}" || "$EP" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: EP='$EP' is invalid: expected an int >= 1 (experts split over EP ranks)" >&2; exit 2; }

# name|config|extra override (capacity factor)
ALL_RUNS=(
    "gpt-$SIZE|configs/gpt-$SIZE.yaml|"
    "dmoe-$SIZE|configs/dmoe-$SIZE.yaml|"
    "moe-$SIZE-cf1|configs/moe-$SIZE.yaml|model.moe.capacity_factor=1.0"
    "moe-$SIZE-cf1.5|configs/moe-$SIZE.yaml|model.moe.capacity_factor=1.5"
    "moe-$SIZE-cf2|configs/moe-$SIZE.yaml|model.moe.capacity_factor=2.0"
)
ALL_NAMES=()
for r in "${ALL_RUNS[@]}"; do ALL_NAMES+=("${r%%|*}"); done
SELECTED=()
if [[ -n "${RUNS:-}" ]]; then
    for want in $RUNS; do
        hit=""
        for r in "${ALL_RUNS[@]}"; do [[ "${r%%|*}" == "$want" ]] && hit="$r"; done
        [[ -n "$hit" ]] || { echo "reproduce.sh: RUNS entry '$want' is invalid: expected some of: ${ALL_NAMES[*]}" >&2; exit 2; }
        SELECTED+=("$hit")
    done
else
    SELECTED=("${ALL_RUNS[@]}")
fi

# Steps from the token budget; the three configs must agree on tokens per step.
read -r STEPS TOKENS_PER_STEP < <("$PY" - "$SIZE" "$TOKENS" "$@" <<'EOF'
import sys
from megatron_moe.training.run_config import ConfigError, load_config
size, tokens, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
per = set()
for kind in ("gpt", "dmoe", "moe"):
    try:
        c = load_config(f"configs/{kind}-{size}.yaml", overrides)
    except ConfigError as e:
        sys.exit(f"reproduce.sh: config error: {e}")
    per.add(c.train.global_batch_size * c.model.seq_length)
if len(per) != 1:
    sys.exit(f"reproduce.sh: gpt/dmoe/moe-{size} differ in tokens per step {sorted(per)}: "
             "give them the same train.global_batch_size and model.seq_length")
(p,) = per
if tokens < p:
    sys.exit(f"reproduce.sh: TOKENS={tokens} is invalid: expected at least one step ({p} tokens)")
print(tokens // p, p)
EOF
) || exit 2
[[ -n "${STEPS:-}" ]] || exit 2
WARMUP="${WARMUP:-$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))}"
EVAL_INTERVAL="${EVAL_INTERVAL:-$(( STEPS / 6 > 0 ? STEPS / 6 : 1 ))}"
EVAL_ITERS="${EVAL_ITERS:-2}"
echo "reproduce $SIZE: ${#SELECTED[@]} runs x $STEPS steps x $TOKENS_PER_STEP tokens = $(( STEPS * TOKENS_PER_STEP )) tokens each" \
     "(TOKENS=$TOKENS), warm-up $WARMUP, eval every $EVAL_INTERVAL steps x $EVAL_ITERS batches, $NPROC GPU(s)," \
     "W&B group $GROUP, runs in $RUNS_DIR, results in $RESULTS"
if [[ "$SIZE" == medium && "$NPROC" -lt 4 ]]; then
    echo "note: dmoe-medium / moe-medium need ~208 GB for weights + AdamW: run with NPROC>=4 EP=4 (or RUNS=gpt-medium)" >&2
fi

show() { printf '+'; printf ' %q' "$@"; printf '\n'; }
run() { show "$@"; [[ "$DRY_RUN" == 1 ]] || "$@"; }
env_name() { local n="${1^^}"; n="${n//-/_}"; echo "MICRO_BATCH_${n//./_}"; }

COMMON=("logging.runs_dir=$RUNS_DIR" "logging.wandb_group=$GROUP" "train.train_iters=$STEPS"
        "train.lr_warmup_iters=$WARMUP" "train.lr_decay_iters=null" "train.eval_interval=$EVAL_INTERVAL"
        "train.eval_iters=$EVAL_ITERS" "train.save_interval=0" "train.save_final=$([[ ${KEEP_CHECKPOINTS:-0} == 1 ]] && echo true || echo false)" "train.log_interval=5"
        "train.exit_interval=null")
[[ "$DRY_RUN" == 1 ]] || mkdir -p "$RESULTS/micro_batch" "$RESULTS/runs" "$RUNS_DIR/logs"
if [[ "$DRY_RUN" != 1 ]] && command -v nvidia-smi >/dev/null; then
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" 2>&1
      date -u +%Y-%m-%dT%H:%M:%SZ; } > "$RESULTS/env.txt" || true
fi

for r in "${SELECTED[@]}"; do
    [[ "${COMPARE_ONLY:-0}" == 1 ]] && break
    IFS='|' read -r NAME CFG CF <<< "$r"
    EXTRA=()
    [[ -n "$CF" ]] && EXTRA+=("$CF")
    [[ -n "${EP:-}" && "$NAME" != gpt-* ]] && EXTRA+=("model.moe.expert_parallel_size=$EP")
    [[ "$NAME" == dmoe-* ]] && EXTRA+=("${DMOE_OVR[@]}")
    OVR=("${COMMON[@]}" "${EXTRA[@]}" "$@")
    if [[ -f "$RUNS_DIR/$NAME/.repro-done" && "${FORCE:-0}" != 1 && "$DRY_RUN" != 1 ]]; then
        echo "== $NAME: done already ($RUNS_DIR/$NAME/.repro-done; FORCE=1 reruns it)"
        continue
    fi

    # 1. micro-batch: environment, else the saved search, else search now
    VAR="$(env_name "$NAME")"
    MB="${!VAR:-}"
    MBJSON="$RESULTS/micro_batch/$NAME.json"
    if [[ -n "$MB" ]]; then
        [[ "$MB" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: $VAR='$MB' is invalid: expected an int >= 1" >&2; exit 2; }
        echo "== $NAME: micro-batch $MB (from $VAR)"
    elif [[ -f "$MBJSON" && "$DRY_RUN" != 1 ]]; then
        MB="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["micro_batch_size"])' "$MBJSON")"
        echo "== $NAME: micro-batch $MB (saved search $MBJSON; delete it to search again)"
    else
        echo "== $NAME: searching the largest micro-batch that fits"
        FIND=("$PY" tools/find_micro_batch.py "$CFG" --nproc "$NPROC" --json "$MBJSON")
        [[ -n "${MB_START:-}" ]] && FIND+=(--start "$MB_START")
        FIND+=("${OVR[@]}")
        if [[ "$DRY_RUN" == 1 ]]; then
            show "${FIND[@]}"
            MB='<found>'
        else
            show "${FIND[@]}"
            MB="$("${FIND[@]}" 2> >(tee "$RUNS_DIR/logs/$NAME.find.log" >&2))" || {
                echo "reproduce.sh: the micro-batch search for $NAME failed (log: $RUNS_DIR/logs/$NAME.find.log)" >&2; exit 1; }
        fi
    fi

    # 2. train for the token budget
    echo "== $NAME: training $STEPS steps"
    if [[ "$NPROC" -gt 1 ]]; then
        TRAIN=(bash scripts/pretrain.sh "$CFG")
    else
        TRAIN=("$PY" -m megatron_moe.training --config "$CFG")
    fi
    TRAIN+=("name=$NAME" "train.micro_batch_size=$MB" "${OVR[@]}")
    if [[ "$DRY_RUN" == 1 ]]; then
        show "${TRAIN[@]}"
        continue
    fi
    rm -rf "${RUNS_DIR:?}/$NAME"   # a fresh run: same tokens for every model
    show "${TRAIN[@]}"
    NPROC="$NPROC" "${TRAIN[@]}" 2>&1 | tee "$RUNS_DIR/logs/$NAME.log" || {
        echo "reproduce.sh: training $NAME failed (log: $RUNS_DIR/logs/$NAME.log)" >&2; exit 1; }
    mkdir -p "$RESULTS/runs/$NAME"
    cp "$RUNS_DIR/$NAME/config.yaml" "$RESULTS/runs/$NAME/"
    gzip -9 -n -c "$RUNS_DIR/$NAME/metrics.jsonl" > "$RESULTS/runs/$NAME/metrics.jsonl.gz"
    rm -f "$RESULTS/runs/$NAME/metrics.jsonl"   # an earlier call's uncompressed copy
    touch "$RUNS_DIR/$NAME/.repro-done"
done

[[ "${NO_COMPARE:-0}" == 1 ]] && exit 0
# 3. the table and plots, from the copies in RESULTS (they rebuild without a GPU): every run of
# this size that has finished, also those of earlier calls (RUNS=... reruns a subset)
DIRS=()
BASE=()
for r in "${ALL_RUNS[@]}"; do
    NAME="${r%%|*}"
    picked=0
    for s in "${SELECTED[@]}"; do [[ "${s%%|*}" == "$NAME" ]] && picked=1; done
    if [[ -f "$RESULTS/runs/$NAME/metrics.jsonl.gz" || -f "$RESULTS/runs/$NAME/metrics.jsonl" \
          || ( "$DRY_RUN" == 1 && $picked == 1 ) ]]; then
        DIRS+=("$RESULTS/runs/$NAME")
        [[ "$NAME" == "gpt-$SIZE" ]] && BASE=(--baseline "gpt-$SIZE")
    fi
done
[[ ${#DIRS[@]} -gt 0 ]] || { echo "reproduce.sh: no finished runs in $RESULTS/runs to compare" >&2; exit 1; }
COMPARE=("$PY" tools/compare_runs.py "${DIRS[@]}" "${BASE[@]}" --plots "$RESULTS/plots"
         --markdown "$RESULTS/table.md" --json "$RESULTS/table.json")
[[ -n "${TARGET_LOSS:-}" ]] && COMPARE+=(--target-loss "$TARGET_LOSS")
if [[ "$DRY_RUN" == 1 ]]; then
    show "${COMPARE[@]}"
else
    show "${COMPARE[@]}"
    "${COMPARE[@]}" | tee "$RESULTS/compare.txt"
fi
