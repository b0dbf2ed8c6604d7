"""scripts/slurm/pretrain.sbatch without Slurm: fake ``srun`` and ``scontrol`` on PATH record
what the job would run (srun's options, torchrun's arguments, the environment), with the
SLURM_* variables a job would see."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"

FAKE_SRUN = f"""#!{sys.executable}
import json, os, sys
print("SRUN " + json.dumps({{"args": sys.argv[1:], "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                             "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}}))
"""
FAKE_SCONTROL = """#!/bin/sh
# scontrol show hostnames LIST
[ "$1 $2" = "show hostnames" ] && printf 'node-a\\nnode-b\\n'
"""


@pytest.fixture
def fake_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def run_job(fake_bin, *args, **env):
    """The script as Slurm would start it: 2 nodes, 8 GPUs and 32 CPUs per task unless overridden."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("SLURM_") and k not in ("OMP_NUM_THREADS", "RESUME", "GPUS_PER_NODE", "SRUN_ARGS")}
    e.update(PATH=f"{fake_bin}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]",
             SLURM_JOB_NUM_NODES="2", SLURM_CPUS_PER_TASK="32", SLURM_GPUS_ON_NODE="8")
    e.update({k: v for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
    proc = subprocess.run(["bash", str(SBATCH), *args], env=e, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (line,) = [s for s in proc.stdout.splitlines() if s.startswith("SRUN ")]
    srun = json.loads(line[5:])
    i = srun["args"].index("torchrun")
    return srun["args"][:i], srun["args"][i + 1:], srun, proc.stdout


def test_syntax_and_the_header():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    header = text[:text.index("\n#SBATCH ")]
    assert "sbatch scripts/slurm/pretrain.sbatch dmoe-medium" in header  # configs by name
    assert "shared by all nodes" in header and "RNG" in header
    assert "SLURM_RESTART_COUNT" in header and "RESUME=1" in header


def test_the_log_opens_without_a_folder_made_by_the_job():
    """Slurm opens --output before the script runs: a folder the script would create is too late."""
    (out,) = re.findall(r"^#SBATCH --output=(\S+)", SBATCH.read_text(), re.M)
    assert "/" not in out, out


def test_launch_names_the_trainer_and_the_rendezvous(fake_bin):
    srun, torchrun, env, stdout = run_job(fake_bin, "dmoe-medium", "train.lr=3e-4")
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun
    assert "--nnodes=2" in torchrun and "--nproc-per-node=8" in torchrun and "--rdzv-id=4242" in torchrun
    assert "--rdzv-endpoint=node-a:29500" in torchrun and "--rdzv-backend=c10d" in torchrun
    i = torchrun.index("-m")
    assert torchrun[i:i + 4] == ["-m", "megatron_moe.training", "--config", "dmoe-medium"]
    assert torchrun[-1] == "train.lr=3e-4" and env["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("cpus,gpus,omp,expect", [
    ("32", "8", None, "4"),      # the task's cores over the node's processes
    ("4", "8", None, "1"),       # at least one
    ("96", "4", None, "24"),
    ("32", "8", "3", "3"),       # the user's setting wins
    (None, "8", None, "1"),      # no --cpus-per-task
])
def test_omp_threads_follow_cpus_per_task(fake_bin, cpus, gpus, omp, expect):
    srun, _, env, _ = run_job(fake_bin, "dmoe-small", SLURM_CPUS_PER_TASK=cpus, SLURM_GPUS_ON_NODE=gpus,
                              OMP_NUM_THREADS=omp)
    assert env["OMP_NUM_THREADS"] == expect


def test_srun_gets_cpus_per_task_again(fake_bin):
    """Slurm >= 22.05: srun's tasks do not inherit sbatch's --cpus-per-task."""
    srun, _, _, _ = run_job(fake_bin, "dmoe-small")
    assert "--cpus-per-task=32" in srun
    srun, _, _, _ = run_job(fake_bin, "dmoe-small", SLURM_CPUS_PER_TASK=None)
    assert not [a for a in srun if a.startswith("--cpus-per-task")]


@pytest.mark.parametrize("env,args,resumes", [
    ({}, [], False),                                   # a new job: a new run
    ({"SLURM_RESTART_COUNT": "0"}, [], False),
    ({"SLURM_RESTART_COUNT": "2"}, [], True),          # requeued by Slurm
    ({"RESUME": "1"}, [], True),                       # asked for
    ({"RESUME": "0"}, [], False),
    ({"RESUME": "1"}, ["--resume"], True),             # given already: once
    ({}, ["--resume", "train.lr=1e-4"], True),
])
def test_resume_only_on_a_restart_or_when_asked(fake_bin, env, args, resumes):
    _, torchrun, _, stdout = run_job(fake_bin, "dmoe-small", *args, **env)
    assert torchrun.count("--resume") == (1 if resumes else 0), torchrun
    assert ("--resume" in stdout.split("SRUN")[0]) == resumes


def test_help_and_missing_config(fake_bin):
    proc = subprocess.run(["bash", str(SBATCH), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "RESUME=1" in proc.stdout and "--job-name" not in proc.stdout
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 2


def test_pretrain_sh_help_is_its_header_only():
    script = REPO / "scripts" / "pretrain.sh"
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "scripts/pretrain.sh dmoe-xs" in proc.stdout
    assert "set -euo" not in proc.stdout  # the help once ran into the script's first command


def test_reproduce_keeps_logs_out_of_the_results_and_gzips_the_metrics(tmp_path):
    """scripts/reproduce.sh end to end with a stand-in trainer (PYTHON is a wrapper that fakes
    `-m megatron_moe.training` and runs everything else, the config checks and compare_runs, for
    real): the results folder gets the gzipped metrics, the config, the table and plots; the
    console logs go to RUNS_DIR/logs."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if args[:2] != ["-m", "megatron_moe.training"]:
    os.execv({sys.executable!r}, [{sys.executable!r}] + args)
opts = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
run = os.path.join(opts["logging.runs_dir"], opts["name"])
os.makedirs(run, exist_ok=True)
open(os.path.join(run, "config.yaml"), "w").write(
    "name: %s\\nmodel: {{seq_length: 1024}}\\ntrain: {{micro_batch_size: 1}}\\n" % opts["name"])
with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    for s in range(1, 3):
        f.write(json.dumps({{"step": s, "consumed_samples": 512 * s, "lm_loss": 5.0 - s, "val_loss": 6.0 - s,
                            "tokens_per_s": 1000.0, "step_time_s": 1.0}}) + "\\n")
print("step 2/2 | fake")
""")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MICRO_BATCH_", "TOKENS", "DRY_RUN"))
           and k not in ("RUNS", "NPROC", "EP", "TAG", "TARGET_LOSS")}
    env.update(PYTHON=str(fake), RUNS="gpt-xs dmoe-xs", MICRO_BATCH_GPT_XS="1", MICRO_BATCH_DMOE_XS="1",
               TOKENS=str(2 * 512 * 1024), RUNS_DIR=str(tmp_path / "runs"), RESULTS=str(tmp_path / "results"),
               PATH=f"{tmp_path / 'nobin'}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "reproduce.sh"), "xs"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = tmp_path / "results"
    for name in ("gpt-xs", "dmoe-xs"):
        assert sorted(p.name for p in (res / "runs" / name).iterdir()) == ["config.yaml", "metrics.jsonl.gz"]
        assert (tmp_path / "runs" / "logs" / f"{name}.log").read_text().startswith("step 2/2")
    assert not (res / "logs").exists()
    assert (res / "table.md").read_text().startswith("| run |") and (res / "plots" / "val_loss_vs_time.png").is_file()
    assert "baseline: gpt-xs" in (res / "compare.txt").read_text()
