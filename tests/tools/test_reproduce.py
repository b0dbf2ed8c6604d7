"""The reproduction recipe on the CPU: tools/find_micro_batch.py and scripts/reproduce.sh.

    pytest tests/test_reproduce.py -q        # ~15 s on 2 cores

The search runs against a fake "run one candidate" that runs out of memory above a
threshold; the OOM classifier reads real-looking PyTorch / torchrun / NCCL error texts; one
real trial (a bad data path) checks that a non-memory failure stops the search with the
program's own error line and leaves no scratch directory; ``DRY_RUN=1 scripts/reproduce.sh``
must list exactly the paper's five runs with one token budget, one W&B group and the compare
step. What needs a GPU (real OOMs, the runs themselves) is not tested here.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import find_micro_batch as fmb  # noqa: E402


# ----------------------------------------------------------------------------- the search


def fake_runner(fits_up_to: int, fail_at: int | None = None):
    """run_one that fits up to ``fits_up_to`` (OOM above) and fails otherwise at ``fail_at``."""
    calls = []

    def run_one(m: int) -> fmb.Trial:
        calls.append(m)
        if m == fail_at:
            return fmb.Trial(m, fmb.FAILED, detail="exit status 1: megatron-moe-train: error: data.paths")
        if m <= fits_up_to:
            return fmb.Trial(m, fmb.FITS, peak_mem_gb=m * 1.5)
        return fmb.Trial(m, fmb.OOM, detail="torch.OutOfMemoryError: CUDA out of memory.")

    return run_one, calls


def test_candidates_are_powers_of_two_dividing_the_per_rank_batch():
    assert fmb.candidate_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert fmb.candidate_sizes(512, 8) == [1, 2, 4, 8, 16, 32, 64]
    assert fmb.candidate_sizes(96) == [1, 2, 4, 8, 16, 32]      # 64 does not divide 96
    assert fmb.candidate_sizes(24, 3) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="data-parallel size 3 .* divides"):
        fmb.candidate_sizes(512, 3)


@pytest.mark.parametrize("threshold,start,expect_calls", [
    (16, 16, [16, 32]),                 # start fits, the next one does not
    (64, 16, [16, 32, 64, 128]),        # doubling up to the first OOM
    (512, 16, [16, 32, 64, 128, 256, 512]),  # the largest candidate fits: no OOM trial needed
    (4, 16, [16, 8, 4]),                # start OOMs: halving down to the first fit
    (1, 512, [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]),
    (20, 24, [16, 32]),                 # start rounded down to a candidate; 20 is no power of 2
])
def test_search_picks_the_largest_fitting_size(threshold, start, expect_calls):
    run_one, calls = fake_runner(threshold)
    cands = fmb.candidate_sizes(512)
    res = fmb.search(cands, run_one, start)
    best = max(c for c in cands if c <= threshold)
    assert res.micro_batch_size == best
    assert calls == expect_calls
    assert [t.micro_batch_size for t in res.trials] == calls
    assert [t.outcome for t in res.trials] == ["fits" if c <= threshold else "oom" for c in calls]


def test_search_default_start_is_largest_first():
    run_one, calls = fake_runner(32)
    res = fmb.search([1, 2, 4, 8, 16, 32, 64, 128], run_one)
    assert res.micro_batch_size == 32 and calls == [128, 64, 32]


def test_search_errors_when_nothing_fits():
    run_one, calls = fake_runner(0)
    with pytest.raises(fmb.SearchError, match="no micro-batch fits: even micro_batch_size=1"):
        fmb.search([1, 2, 4], run_one, 2)
    assert calls == [2, 1]


def test_search_stops_at_a_non_memory_failure():
    run_one, calls = fake_runner(64, fail_at=32)
    with pytest.raises(fmb.SearchError, match=r"micro_batch_size=32 failed for a reason other than "
                                              r"memory(.|\n)*data\.paths"):
        fmb.search(fmb.candidate_sizes(512), run_one, 16)
    assert calls == [16, 32]  # nothing after the failure


# ----------------------------------------------------------------------------- the classifier


TORCH_OOM = """\
step 1/60 | lm_loss 10.9
Traceback (most recent call last):
  File "/work/megatron_moe/train.py", line 412, in _train
    (lm / num_micro).backward()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.25 GiB. GPU 0 has a total capacity \
of 79.19 GiB of which 2.94 GiB is free. Including non-PyTorch memory, this process has 76.24 GiB \
memory in use. Of the allocated memory 71.02 GiB is allocated by PyTorch
"""
TORCHRUN_OOM = """\
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB.
E1122 12:00:00 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
megatron_moe.training FAILED
"""
RAW_CUDA_OOM = "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"
CUBLAS_OOM = ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
              "`cublasCreate(handle)`")
NCCL_OOM = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
            "unhandled cuda error, NCCL version 2.21.5\nLast error:\nCuda failure 'out of memory'")
CONFIG_ERROR = ("megatron-moe-train: config error: unknown key 'train.bogus': valid keys in 'train' "
                "are micro_batch_size, ...")
TRITON_RESOURCES = ("triton.runtime.errors.OutOfResources: out of resource: shared memory, "
                    "Required: 262144, Hardware limit: 232448.")
ILLEGAL_ACCESS = "RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("text", [TORCH_OOM, TORCHRUN_OOM, RAW_CUDA_OOM, CUBLAS_OOM, NCCL_OOM])
def test_classifier_recognises_out_of_memory(text):
    outcome, detail = fmb.classify(1, text, reached_step2=False)
    assert outcome == fmb.OOM
    assert detail and detail in text  # the matching line, for the log


def test_classifier_oom_wins_even_after_step_2():
    # an OOM at step 2's checkpoint or evaluation is still an OOM
    assert fmb.classify(1, TORCH_OOM, reached_step2=True)[0] == fmb.OOM


@pytest.mark.parametrize("text", [CONFIG_ERROR, TRITON_RESOURCES, ILLEGAL_ACCESS, ""])
def test_classifier_other_failures_are_not_oom(text):
    outcome, detail = fmb.classify(1, text, reached_step2=False)
    assert outcome == fmb.FAILED
    assert detail.startswith("exit status 1")
    assert text.splitlines()[-1] in detail if text else "no output" in detail


def test_classifier_step_2_without_error_fits():
    assert fmb.classify(-15, "step 1/60 ...\nstep 2/60 ...\n", reached_step2=True) == (fmb.FITS, "")


def test_trial_command_is_a_scratch_two_step_run():
    cmd = fmb.trial_command("configs/dmoe-xs.yaml", ["train.exit_interval=null", "logging.runs_dir=runs/x"],
                            16, "/tmp/scratch", 1)
    assert cmd[1:3] == ["-m", "megatron_moe.training"]
    tail = cmd[cmd.index("logging.runs_dir=runs/x") + 1:]   # ours come last, so they win
    for o in ("train.micro_batch_size=16", "train.exit_interval=2", "train.eval_interval=0",
              "logging.wandb=false", "logging.runs_dir=/tmp/scratch", "name=mbs-probe-16"):
        assert o in tail
    assert "--nproc-per-node=4" in fmb.trial_command("c.yaml", [], 2, "/tmp/s", 4)


def test_real_trial_failure_stops_with_the_programs_error(tmp_path):
    """One real subprocess (fails fast at data loading): FAILED, the error line, scratch removed."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run_one = fmb.make_subprocess_runner(
        "configs/tiny-cpu.yaml", ["data.paths=[/no/such/file.txt]", f"data.cache_dir={tmp_path / 'cache'}"],
        timeout_s=120, scratch_parent=str(scratch))
    t = run_one(8)
    assert t.outcome == fmb.FAILED
    assert "data.paths" in t.detail and "does not exist" in t.detail
    assert list(scratch.iterdir()) == []


# ----------------------------------------------------------------------------- reproduce.sh


def _dry(size="xs", *args, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MICRO_BATCH_")
         and k not in ("TOKENS", "RUNS", "NPROC", "EP", "RUNS_DIR", "RESULTS", "WARMUP",
                       "EVAL_INTERVAL", "EVAL_ITERS", "TARGET_LOSS")}
    e.update(DRY_RUN="1", PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(REPO / "scripts" / "reproduce.sh"), size, *args], cwd=REPO,
                          env=e, capture_output=True, text=True, timeout=60)


def _commands(out: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def _opts(cmd: list[str]) -> dict:
    return dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))


def test_dry_run_lists_the_five_runs_with_one_budget(tmp_path):
    proc = _dry("xs")
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    train = [c for c in cmds if c[1:3] == ["-m", "megatron_moe.training"]]
    find = [c for c in cmds if "tools/find_micro_batch.py" in c]
    compare = [c for c in cmds if "tools/compare_runs.py" in c]
    names = [_opts(c)["name"] for c in train]
    assert names == ["gpt-xs", "dmoe-xs", "moe-xs-cf1", "moe-xs-cf1.5", "moe-xs-cf2"]
    configs = [c[c.index("--config") + 1] for c in train]
    assert configs == ["configs/gpt-xs.yaml", "configs/dmoe-xs.yaml"] + ["configs/moe-xs.yaml"] * 3
    opts = [_opts(c) for c in train]
    assert [o.get("model.moe.capacity_factor") for o in opts] == [None, None, "1.0", "1.5", "2.0"]
    for key in ("train.train_iters", "train.lr_warmup_iters", "train.eval_interval", "train.eval_iters",
                "logging.wandb_group", "logging.runs_dir"):
        assert len({o[key] for o in opts}) == 1, key
    assert opts[0]["train.train_iters"] == "60"   # 31457280 tokens / (512 x 1024)
    assert opts[0]["logging.wandb_group"] == "repro-xs"
    assert opts[0]["logging.runs_dir"] == "runs/repro-xs"
    assert "31457280 tokens each" in proc.stdout
    # one search per run, with the run's own overrides (capacity factor included)
    assert len(find) == 5
    assert [_opts(c).get("model.moe.capacity_factor") for c in find] == [None, None, "1.0", "1.5", "2.0"]
    assert all(_opts(c)["train.train_iters"] == "60" for c in find)
    # the comparison, last, over the committed copies of the five runs
    assert len(compare) == 1 and cmds[-1] is compare[0]
    c = compare[0]
    assert c[c.index("--baseline") + 1] == "gpt-xs"
    assert [a for a in c if a.startswith("benchmarks/results/repro-xs/runs/")] == \
        [f"benchmarks/results/repro-xs/runs/{n}" for n in names]
    for flag, value in (("--plots", "plots"), ("--markdown", "table.md"), ("--json", "table.json")):
        assert c[c.index(flag) + 1] == f"benchmarks/results/repro-xs/{value}"
    assert "--target-loss" not in c  # the default: the worst final validation loss
    c = next(c for c in _commands(_dry("xs", TARGET_LOSS="baseline").stdout) if "tools/compare_runs.py" in c)
    assert c[c.index("--target-loss") + 1] == "baseline"
    # a dry run writes nothing
    proc = _dry("xs", RUNS_DIR=str(tmp_path / "runs"), RESULTS=str(tmp_path / "results"))
    assert proc.returncode == 0 and list(tmp_path.iterdir()) == []


def test_dry_run_tokens_micro_batch_env_and_overrides():
    proc = _dry("small", "data.cache_dir=/tmp/x", TOKENS=str(120 * 512 * 1024), MICRO_BATCH_GPT_SMALL="64",
                MICRO_BATCH_MOE_SMALL_CF1_5="2", NPROC="2", EP="2")
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    train = [c for c in cmds if "scripts/pretrain.sh" in c]      # NPROC > 1: torchrun
    assert len(train) == 5
    opts = {_opts(c)["name"]: _opts(c) for c in train}
    assert all(o["train.train_iters"] == "120" and o["data.cache_dir"] == "/tmp/x" for o in opts.values())
    assert opts["gpt-small"]["train.micro_batch_size"] == "64"
    assert opts["moe-small-cf1.5"]["train.micro_batch_size"] == "2"
    assert "model.moe.expert_parallel_size" not in opts["gpt-small"]
    assert opts["dmoe-small"]["model.moe.expert_parallel_size"] == "2"
    find = [c for c in cmds if "tools/find_micro_batch.py" in c]
    assert len(find) == 3 and all(c[c.index("--nproc") + 1] == "2" for c in find)
    # overrides for the dropless runs only (the capacity-factor runs cannot take the symmetric exchange)
    proc = _dry("small", NPROC="8", EP="8", DMOE_OVERRIDES="model.moe.a2a_splits=symmetric train.cuda_graphs=auto")
    assert proc.returncode == 0, proc.stderr
    opts = {_opts(c)["name"]: _opts(c) for c in _commands(proc.stdout) if "scripts/pretrain.sh" in c}
    assert opts["dmoe-small"]["model.moe.a2a_splits"] == "symmetric"
    assert opts["dmoe-small"]["train.cuda_graphs"] == "auto"
    assert all("model.moe.a2a_splits" not in o for n, o in opts.items() if n != "dmoe-small")


@pytest.mark.parametrize("args,env,message", [
    (["xl"], {}, "SIZE 'xl' is invalid: expected xs, small or medium"),
    (["xs"], {"TOKENS": "1000"}, "TOKENS=1000 is invalid: expected at least one step (524288 tokens)"),
    (["xs"], {"TOKENS": "lots"}, "TOKENS='lots' is invalid: expected a positive integer"),
    (["xs"], {"RUNS": "moe-xs"}, "RUNS entry 'moe-xs' is invalid: expected some of: gpt-xs dmoe-xs"),
    (["xs"], {"MICRO_BATCH_GPT_XS": "0"}, "MICRO_BATCH_GPT_XS='0' is invalid: expected an int >= 1"),
    (["xs", "lr"], {}, "override 'lr' is invalid: expected key=value"),
    (["xs"], {"DMOE_OVERRIDES": "symmetric"}, "DMOE_OVERRIDES entry 'symmetric' is invalid: expected key=value"),
    (["xs", "train.bogus=1"], {}, "config error: unknown key 'train.bogus'"),
])
def test_bad_input_is_one_line(args, env, message):
    proc = _dry(*args, **env)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_help_and_syntax():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "reproduce.sh")], check=True)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "reproduce.sh"), "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "DRY_RUN=1" in proc.stdout and "MICRO_BATCH_" in proc.stdout
    assert not re.search(r"^set -", proc.stdout, re.M)
    assert "Exit status" in fmb.__doc__ or "exit status" in fmb.__doc__.lower()


def test_dry_run_tag_and_search_start():
    proc = _dry("xs", TAG="gb64", MB_START="16", RUNS="dmoe-xs")
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    (find,) = [c for c in cmds if "tools/find_micro_batch.py" in c]
    assert find[find.index("--start") + 1] == "16"
    (train,) = [c for c in cmds if c[1:3] == ["-m", "megatron_moe.training"]]
    assert _opts(train)["logging.runs_dir"] == "runs/repro-xs-gb64"
    assert _opts(train)["logging.wandb_group"] == "repro-xs-gb64"
    (compare,) = [c for c in cmds if "tools/compare_runs.py" in c]
    assert compare[compare.index("--markdown") + 1] == "benchmarks/results/repro-xs-gb64/table.md"


def _parallel(*args, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MICRO_BATCH_", "TOKENS"))
         and k not in ("RUNS", "NPROC", "EP", "RUNS_DIR", "RESULTS", "GPUS", "NGPUS", "TAG")}
    e.update(DRY_RUN="1", PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(REPO / "scripts" / "reproduce_parallel.sh"), *args], cwd=REPO,
                          env=e, capture_output=True, text=True, timeout=120)


def test_parallel_dry_run_one_run_per_gpu_then_the_tables(tmp_path):
    proc = _parallel("xs:gpt-xs", "xs:dmoe-xs", "small:gpt-small", "--", "data.cache_dir=/tmp/x",
                     GPUS="4 5", TOKENS_XS=str(2 * 512 * 1024), TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    # the i-th run on GPU GPUS[i mod 2], each GPU in order
    got = sorted(re.findall(r"== GPU (\d): (\w+) ([\w.-]+)\n", proc.stdout))
    assert got == [("4", "small", "gpt-small"), ("4", "xs", "gpt-xs"), ("5", "xs", "dmoe-xs")]
    for size, name, steps in (("xs", "gpt-xs", "2"), ("xs", "dmoe-xs", "2"), ("small", "gpt-small", "60")):
        out = (tmp_path / f"reproduce-{size}-{name}.out").read_text()
        (train,) = [c for c in _commands(out) if c[1:3] == ["-m", "megatron_moe.training"]]
        assert _opts(train)["name"] == name and _opts(train)["train.train_iters"] == steps
        assert _opts(train)["data.cache_dir"] == "/tmp/x"
        assert "tools/compare_runs.py" not in out      # NO_COMPARE: the tables come once, at the end
    # then one table per size, over that size's runs, training nothing
    cmds = _commands(proc.stdout)
    assert not [c for c in cmds if c[1:3] == ["-m", "megatron_moe.training"]]
    compare = [c for c in cmds if "tools/compare_runs.py" in c]
    assert [c[c.index("--markdown") + 1] for c in compare] == \
        ["benchmarks/results/repro-small/table.md", "benchmarks/results/repro-xs/table.md"]


@pytest.mark.parametrize("args,env,message", [
    ([], {}, "no runs given: expected SIZE:RUN arguments"),
    (["xl:gpt-xl"], {}, "run 'xl:gpt-xl' is invalid: expected SIZE:RUN with SIZE xs, small or medium"),
    (["xs:gpt-xs"], {"GPUS": "a b"}, "GPUS='a b' is invalid: expected GPU indices"),
])
def test_parallel_bad_input_is_one_line(args, env, message):
    proc = _parallel(*args, **env)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
