"""Megatron-LM's own pretrain_gpt.py with our layer spec, side by side on one GPU, in one call.

    # on the GPU machine, from the repository root (Megatron-LM's source tree at $MLM; wheels
    # for megatron-core and pydantic in .whl/, installed by benchmarks/device_env.sh):
    MLM=.mlm python3 benchmarks/megatron_lm.py --out $OUT [--stages dense,dense-sdpa,...]

Runs (the XS shapes of the paper, dmoe-xs / gpt-xs: 6 layers, hidden 512, ffn 2048, 64
experts top-1 for the MoE runs; global batch 64 x 1024 tokens, micro-batch 32, bf16, mock data,
no dropout):

  dense        Megatron-LM's local spec, dense (its unfused attention: no TE, no Apex)
  dense-sdpa   our spec, dense (MEGATRON_MOE_CONFIG=gpt-xs): megatron-core's layers with our
               SDPA attention
  dmoe         our spec configured by Megatron's flags (--num-experts 64 --moe-router-topk 1
               --moe-router-pre-softmax --moe-aux-loss-coeff ...), --save at the middle step
  resume       the dmoe run again from its middle checkpoint (--load): its losses against the
               straight run's
  dmoe-gaf     the dmoe run with Megatron's --gradient-accumulation-fusion (its default; without
               Apex through megatron_moe/megatron/grad_accum.py): its losses against dmoe's
  dmoe-cefusion the dmoe run with Megatron's own fused cross-entropy (--cross-entropy-loss-fusion
               --cross-entropy-fusion-impl native; ours is not pluggable into its GPTModel)
  dmoe-distopt the dmoe run with --use-distributed-optimizer: its losses against dmoe's
  dmoe-det, resume-det   dmoe and resume with --deterministic-mode (NCCL_ALGO=Ring,
               CUBLAS_WORKSPACE_CONFIG=:4096:8): the resumed losses equal the straight run's
  mcore-moe    megatron-core's own MoE layer with the same flags (local spec: SequentialMLP; its
               grouped GEMM needs Transformer Engine or the grouped_gemm package; its fused bias-GeLU does
               not take the experts' per-token scale: --no-bias-gelu-fusion; its expert MLP adds the
               bias in place into a view at tensor-parallel size 1, which autograd refuses:
               --disable-bias-linear, bias-free experts like ours). megatron-core
               0.16.1's router names te_general_gemm, defined only when Transformer Engine imports:
               the launcher (_mlm_launch.py) defines it as None, the router's own fallback
  ours         our training program on the same model and batch (its data: the built-in corpus)
  readme       the README's Megatron-LM commands as written: the command megatron-moe-megatron-lm-args
               prints for dmoe-xs (its own batch: 512 x 1024 tokens, micro-batch 16) with --save,
               run twice (steps 1-20 with a checkpoint, then resumed to 40), against one run of the
               same command straight to 40 without checkpoints; losses compared step by step
               (MLM_README_FLAGS: more flags, e.g. --deterministic-mode; MLM_README_OVERRIDES: more
               overrides, e.g. train.global_batch_size=64)
  ep           on every GPU of the machine (N): the dmoe run at expert-parallel size 1, 2, 4, ...
               up to N (--expert-model-parallel-size; data-parallel N), micro-batch 8,
               --deterministic-mode: each size's losses against size 1's, tokens/s per GPU
               (issue #36; on one GPU it runs size 1 alone)
  profile-dmoe, profile-dense-sdpa   step 30 of the dmoe / dense-sdpa run under torch.profiler
               (Megatron-LM's --profile --use-pytorch-profiler): GPU time by kernel, GPU busy
               time against the step's wall time, in profile_NAME.txt

Tokens/s: median of the last half of the steps. Prints one table last; logs in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = 40
GB, MB, SEQ = 64, 32, 1024
MODEL = ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8", "--ffn-hidden-size", "2048",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--position-embedding-type",
         "learned_absolute", "--init-method-std", "0.01", "--attention-dropout", "0", "--hidden-dropout", "0"]
TRAIN = ["--micro-batch-size", str(MB), "--global-batch-size", str(GB), "--train-iters", str(STEPS),
         "--lr", "6e-4", "--min-lr", "6e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
         "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
         "--bf16", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "51199",
         "--split", "99,1,0", "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1",
         "--log-throughput", "--transformer-impl", "local", "--no-persist-layer-norm",
         "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--distributed-backend", "nccl"]
MOE_FLAGS = ["--num-experts", "64", "--moe-router-topk", "1", "--moe-router-pre-softmax",
             "--moe-aux-loss-coeff", "0.0166667"]
SPEC = ["--spec", "megatron_moe.megatron.spec", "layer_spec"]
DET_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # as --deterministic-mode asks

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                     r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+))?.*?lm loss: ([\d.E+-]+)")


def megatron_lm(name: str, out: Path, mlm: Path, extra: list[str], env: dict | None = None,
                timeout: int = 900, drop: tuple[str, ...] = (), flags: list[str] | None = None,
                nproc: int = 1, micro: int | None = None) -> dict:
    """One pretrain_gpt.py run; its per-iteration times, TFLOP/s and losses (``drop``: flags of
    TRAIN left out; ``flags``: all of pretrain_gpt.py's flags instead of MODEL, TRAIN and extra;
    ``nproc``: GPUs, tokens/s per GPU; ``micro``: the micro-batch instead of MB)."""
    train = [a for a in TRAIN if a not in drop]
    if micro is not None:
        train[train.index("--micro-batch-size") + 1] = str(micro)
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), str(Path(__file__).with_name("_mlm_launch.py")),
           str(mlm / "pretrain_gpt.py"), *(flags if flags is not None else [*MODEL, *train, *extra])]
    log = out / f"mlm_{name}.log"
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            timeout=timeout).returncode
    text = log.read_text()
    rows = {int(m[1]): (float(m[2]), float(m[3]) if m[3] else None, float(m[4])) for m in ITER_RE.finditer(text)}
    result = {"name": name, "rc": rc, "wall_s": round(time.time() - t0, 1),
              "losses": {i: r[2] for i, r in rows.items()}}
    late = [r for i, r in sorted(rows.items()) if i > STEPS // 2]
    if late:
        ms = statistics.median(r[0] for r in late)
        result["ms_per_step"] = ms
        result["tokens_per_s"] = GB * SEQ / (ms / 1000) / nproc
        tf = [r[1] for r in late if r[1] is not None]
        result["tflops"] = statistics.median(tf) if tf else None
    if rc != 0:
        result["error"] = "\n".join(text.splitlines()[-15:])
    return result


def kernel_table(trace_dir: Path, top: int = 30) -> str:
    """GPU time by kernel name in the profiled step (a chrome trace of torch.profiler), the GPU's
    busy time and the step's wall time."""
    import gzip

    paths = sorted(trace_dir.rglob("*.json*"))
    if not paths:
        return f"no trace in {trace_dir}"
    raw = paths[-1].read_bytes()
    events = json.loads(gzip.decompress(raw) if paths[-1].suffix == ".gz" else raw)["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"] / 1e3
    busy = sum(by_name.values())
    wall = sum(e["dur"] for e in steps) / 1e3 if steps else float("nan")
    lines = [f"{paths[-1].name}: step wall {wall:.1f} ms, GPU kernels {busy:.1f} ms ({len(kernels)} launches)",
             "| ms | share | kernel |", "|---|---|---|"]
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {ms:.2f} | {ms / busy:.1%} | {name[:140]} |")
    return "\n".join(lines)


def our_trainer(out: Path) -> dict:
    """Our training program, dmoe-xs at the same batch (bf16, no dropout: the same model)."""
    runs = Path("/tmp/ours-runs")
    shutil.rmtree(runs, ignore_errors=True)
    cmd = [sys.executable, "-m", "megatron_moe.training", "--config", "dmoe-xs", "logging.wandb=false",
           f"logging.runs_dir={runs}", f"train.global_batch_size={GB}", f"train.micro_batch_size={MB}",
           f"train.train_iters={STEPS}", "train.lr_warmup_iters=10", "train.eval_interval=0",
           "train.save_interval=0", "train.save_final=false", "train.log_interval=10",
           "data.default_corpus_mb=4", "data.cache_dir=/tmp/ours-data"]
    log = out / "ours.log"
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    result = {"name": "ours", "rc": rc, "wall_s": round(time.time() - t0, 1)}
    metrics = runs / "dmoe-xs" / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        shutil.copy(metrics, out / "ours_metrics.jsonl")
        late = [r for r in rows if r.get("step", 0) > STEPS // 2 and r.get("tokens_per_s")]
        if late:
            result["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in late)
            result["tflops"] = statistics.median(r["tflops_per_gpu"] for r in late)
            result["ms_per_step"] = GB * SEQ / result["tokens_per_s"] * 1000
        result["losses"] = {r["step"]: r["lm_loss"] for r in rows if "lm_loss" in r}
    if rc != 0:
        result["error"] = "\n".join(log.read_text().splitlines()[-15:])
    return result


README_OVERRIDES = ["train.train_iters=40", "train.lr_warmup_iters=10", "train.exit_interval=20",
                    "train.log_interval=1"]


def readme(out: Path, mlm: Path, record) -> None:
    """The README's commands: the tool's dmoe-xs command with --save run twice (1-20, then
    resumed to 40), and the same command straight to 40 without checkpoints."""
    from megatron_moe.megatron.yaml_config import find_config
    from megatron_moe.tools.megatron_lm_args import megatron_lm_command
    from megatron_moe.training.run_config import load_config

    ckpt = Path("/tmp/mlm-readme-ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    overrides = README_OVERRIDES + os.environ.get("MLM_README_OVERRIDES", "").split()
    more = os.environ.get("MLM_README_FLAGS", "").split()  # e.g. --deterministic-mode
    cfg = load_config(find_config("dmoe-xs"), overrides)
    flags, env, _ = megatron_lm_command(cfg, "dmoe-xs", overrides, 1, save=str(ckpt))
    flags = flags + more
    if "--deterministic-mode" in more:
        env = {**env, **DET_ENV}
    (out / "readme_command.txt").write_text(" ".join(f"{k}={v}" for k, v in env.items()) + " pretrain_gpt.py "
                                           + " ".join(flags) + "\n")
    first = megatron_lm("readme-1", out, mlm, [], env=env, flags=flags)
    second = megatron_lm("readme-2", out, mlm, [], env=env, flags=flags)
    straight_cfg = load_config(find_config("dmoe-xs"), overrides + ["train.exit_interval=null"])
    straight_flags, _, _ = megatron_lm_command(straight_cfg, "dmoe-xs", overrides, 1)
    straight_flags = straight_flags + more
    straight = megatron_lm("readme-straight", out, mlm, [], env=env, flags=straight_flags)
    for r in (first, second, straight):
        r.pop("ms_per_step", None)  # medians over steps 21-40 of a 512-sequence batch: not the table's
        r.pop("tokens_per_s", None)
    resumed = {**first["losses"], **second["losses"]}
    both = sorted(set(resumed) & set(straight["losses"]))
    second["compared"] = f"steps {both[0]}-{both[-1]} (1-20, then resumed) against readme-straight" if both else None
    second["max_loss_diff"] = max((abs(resumed[i] - straight["losses"][i]) for i in both), default=None)
    for r in (first, second, straight):
        record(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device_out")))
    ap.add_argument("--stages", default="dense,dense-sdpa,dmoe,resume,dmoe-distopt,dmoe-det,resume-det,mcore-moe,ours")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    mlm = Path(os.environ.get("MLM", ".mlm")).resolve()
    stages = args.stages.split(",")
    ckpt = Path("/tmp/mlm-ckpt")
    results = []

    def record(r):
        results.append(r)
        (out / "megatron_lm.json").write_text(json.dumps(results, indent=1))
        print(f"{r['name']}: rc {r['rc']} wall {r['wall_s']} s tokens/s {r.get('tokens_per_s')}", flush=True)
        if r.get("error"):
            print(r["error"], flush=True)

    if "dense" in stages:
        record(megatron_lm("dense", out, mlm, []))
    if "dense-sdpa" in stages:
        record(megatron_lm("dense-sdpa", out, mlm, SPEC, env={"MEGATRON_MOE_CONFIG": "gpt-xs"}))

    def against(r, name):  # the largest loss difference to an earlier run, over the steps both ran
        ref = next((x for x in results if x["name"] == name), None)
        if ref:
            both = sorted(set(r["losses"]) & set(ref["losses"]))
            r["compared"] = f"steps {both[0]}-{both[-1]} against {name}" if both else None
            r["max_loss_diff"] = max((abs(r["losses"][i] - ref["losses"][i]) for i in both), default=None)
        return r

    for det in ("", "-det"):
        extra, env = (["--deterministic-mode"], DET_ENV) if det else ([], None)
        if "dmoe" + det in stages:
            shutil.rmtree(ckpt, ignore_errors=True)
            record(megatron_lm("dmoe" + det, out, mlm, SPEC + MOE_FLAGS + extra + [
                "--save", str(ckpt), "--save-interval", str(STEPS // 2)], env=env))
        if "resume" + det in stages:
            # the checkpoint of the last step is there too: point Megatron at the middle one
            (ckpt / "latest_checkpointed_iteration.txt").write_text(str(STEPS // 2))
            record(against(megatron_lm("resume" + det, out, mlm, SPEC + MOE_FLAGS + extra + [
                "--load", str(ckpt), "--save", str(ckpt) + "-2", "--save-interval", "100000"], env=env),
                "dmoe" + det))
    if "dmoe-distopt" in stages:
        record(against(megatron_lm("dmoe-distopt", out, mlm, SPEC + MOE_FLAGS + ["--use-distributed-optimizer"]),
                       "dmoe"))
    if "dmoe-gaf" in stages:  # Megatron's --gradient-accumulation-fusion, through our stand-in for Apex's
        record(against(megatron_lm("dmoe-gaf", out, mlm, SPEC + MOE_FLAGS,
                                   drop=("--no-gradient-accumulation-fusion",)), "dmoe"))
    if "dmoe-cefusion" in stages:  # Megatron's own fused cross-entropy (its native impl, no TE): our
        # fused loss cannot be plugged into Megatron-LM's GPTModel without patching it
        record(against(megatron_lm("dmoe-cefusion", out, mlm, SPEC + MOE_FLAGS + [
            "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]), "dmoe"))
    if "mcore-moe" in stages:
        record(megatron_lm("mcore-moe", out, mlm, MOE_FLAGS + ["--no-bias-gelu-fusion", "--disable-bias-linear"]))
    if "ours" in stages:
        record(our_trainer(out))
    if "ep" in stages:  # issue #36: Megatron's expert parallelism with our layer, on every GPU here
        import torch

        n = torch.cuda.device_count()
        for ep in [p for p in (1, 2, 4, 8) if p <= n and n % p == 0]:
            r = megatron_lm(f"ep{ep}-of-{n}", out, mlm, SPEC + MOE_FLAGS + [
                "--expert-model-parallel-size", str(ep), "--deterministic-mode"], env=DET_ENV, nproc=n, micro=8)
            record(against(r, f"ep1-of-{n}") if ep > 1 else r)
    if "readme" in stages:
        readme(out, mlm, record)
    for name, extra, env in (("dmoe", SPEC + MOE_FLAGS, None),
                             ("dense-sdpa", SPEC, {"MEGATRON_MOE_CONFIG": "gpt-xs"})):
        if f"profile-{name}" in stages:
            tb = Path(f"/tmp/mlm-profile-{name}")
            shutil.rmtree(tb, ignore_errors=True)
            r = megatron_lm(f"profile-{name}", out, mlm, extra + [
                "--profile", "--use-pytorch-profiler", "--profile-step-start", "30", "--profile-step-end", "31",
                "--tensorboard-dir", str(tb)], env=env)
            table = kernel_table(tb)
            (out / f"profile_{name}.txt").write_text(table + "\n")
            print(table, flush=True)
            record(r)

    print("\n| run | tokens/s | ms/step | TFLOP/s/GPU | loss at step 40 | note |\n|---|---|---|---|---|---|")
    for r in results:
        tps = f"{r['tokens_per_s'] / 1e3:.0f}k" if r.get("tokens_per_s") else "-"
        ms = f"{r['ms_per_step']:.0f}" if r.get("ms_per_step") else "-"
        tf = f"{r['tflops']:.1f}" if r.get("tflops") else "-"
        loss = r.get("losses", {}).get(STEPS)
        note = "failed" if r["rc"] else ""
        if r.get("compared") and r.get("max_loss_diff") is not None:
            note = f"{r['compared']}: max loss difference {r['max_loss_diff']:.2e}"
        print(f"| {r['name']} | {tps} | {ms} | {tf} | {loss if loss is None else f'{loss:.4f}'} | {note} |")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
