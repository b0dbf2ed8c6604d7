"""One writer per run directory (megatron_moe/training/run_lock.py), and how a run ends.

    python -m pytest -q tests/training/test_run_lock.py          # about a minute on 2 CPU cores

Units: the lock file's contents; a second trainer refused with the holder named; a dead holder
on this host taken over with a note (a dead pid, or a pid now another process's); a holder on
another host, or in another pid namespace (a container), never judged, except an earlier run of
the same requeued Slurm job; a late taker that never removes a fresh lock; an unreadable
lock named with the fix; a release that leaves someone else's lock alone; trainers starting at
once, on a free and on an abandoned lock, of which exactly one gets it (separate processes that
load run_lock.py alone, without torch, so many fit in memory).

End to end: a second trainer on a run directory a trainer holds stops at once (one line, nothing
written), then the holder is killed and the next start takes the lock over and resumes; under
torchrun every rank stops when rank 0 cannot take it. Out of memory (injected through the fault
hook ``raise_oom_at_step``, the CPU allocator's error) at start-up or in a step ends the run in
one line naming the micro-batch size and the fixes, with the logs closed and the lock released.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_moe.tools.find_micro_batch import OOM, classify
from megatron_moe.training import train as train_mod
from megatron_moe.training.fault_hooks import hooks
from megatron_moe.training.run_config import load_config
from megatron_moe.training.run_lock import RunLock, RunLockError
from megatron_moe.training.train import TrainError, pretrain

sys.path.insert(0, str(Path(__file__).parent))
from _trainer import REPO, TINY, run_trainer, tiny_args, tiny_workdir, trainer_cmd, trainer_env  # noqa: E402

RUN_LOCK = REPO / "megatron_moe" / "training" / "run_lock.py"


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def _write_lock(run_dir: Path, **holder) -> dict:
    holder = {"host": socket.gethostname(), "pid": _dead_pid(), "since": "2026-01-02T03:04:05+00:00",
              "command": "megatron-moe-train --config x", "pid_ns": os.readlink("/proc/self/ns/pid"), **holder}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".lock").write_text(json.dumps(holder) + "\n")
    return holder


def _holder(run_dir: Path) -> dict:
    return json.loads((run_dir / ".lock").read_text())


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


# ----------------------------------------------------------------------------- the lock


def test_lock_names_its_holder_and_refuses_a_second_trainer(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    lock = RunLock.acquire(run_dir)  # creates the run directory
    held = _holder(run_dir)
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    assert held["pid_ns"] == os.readlink("/proc/self/ns/pid")
    assert held["command"] == shlex.join(sys.argv)
    assert abs(time.time() - time.mktime(time.strptime(held["since"][:19], "%Y-%m-%dT%H:%M:%S"))) < 120
    with pytest.raises(RunLockError) as e:
        RunLock.acquire(run_dir)
    msg = str(e.value)
    assert "\n" not in msg
    for part in (f"run directory {run_dir} is in use by another trainer", f"host {socket.gethostname()}",
                 f"pid {os.getpid()}", f"since {held['since']}", "wait for it to finish", "name=",
                 f"if that process is gone, delete {run_dir / '.lock'}"):
        assert part in msg, (part, msg)
    lock.release()
    assert not (run_dir / ".lock").exists()
    RunLock.acquire(run_dir).release()  # free again


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    gone = _write_lock(tmp_path)
    lock = RunLock.acquire(tmp_path)
    assert lock.replaced == gone and _holder(tmp_path)["pid"] == os.getpid()
    assert lock.note() == (f"note: took over {tmp_path / '.lock'} from a trainer that is gone "
                           f"(host {gone['host']}, pid {gone['pid']}, since {gone['since']})")
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing set aside is left
    lock.release()


def test_a_pid_reused_by_another_process_is_not_the_holder(tmp_path):
    """The holder's pid is alive (this process) but started at another time: another process."""
    _write_lock(tmp_path, pid=os.getpid(), proc_start="1")
    lock = RunLock.acquire(tmp_path)
    assert lock.replaced["proc_start"] == "1"
    lock.release()
    mine = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()[19]
    _write_lock(tmp_path, pid=os.getpid(), proc_start=mine)
    with pytest.raises(RunLockError, match="is in use by another trainer"):
        RunLock.acquire(tmp_path)


def test_lock_from_another_pid_namespace_is_not_judged(tmp_path):
    """A container on this host (the same host name): its pids mean nothing here."""
    held = _write_lock(tmp_path, pid_ns="pid:[1]")
    with pytest.raises(RunLockError, match=f"in use by another trainer .*pid {held['pid']},"):
        RunLock.acquire(tmp_path)
    assert _holder(tmp_path) == held


def test_lock_from_another_host_is_not_judged(tmp_path):
    held = _write_lock(tmp_path, host="node-elsewhere-17")
    with pytest.raises(RunLockError) as e:
        RunLock.acquire(tmp_path)
    msg = str(e.value)
    for part in ("locked by a trainer on another host", "host node-elsewhere-17", f"pid {held['pid']}",
                 "this host cannot tell whether that job is alive",
                 f"if it is gone, delete {tmp_path / '.lock'} by hand"):
        assert part in msg, (part, msg)
    assert _holder(tmp_path) == held  # untouched


def test_requeued_slurm_job_takes_over_its_earlier_run(tmp_path, monkeypatch):
    """Slurm ends a job before requeuing it: the same job id with a lower restart count is
    gone, wherever it ran; another job, or this very run, is not."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for job, restart, taken in (("4242", 0, True), ("4242", 1, False), ("999", 0, False)):
        held = _write_lock(tmp_path, host="node-elsewhere-17", slurm_job_id=job, slurm_restart_count=restart)
        if taken:
            lock = RunLock.acquire(tmp_path)
            assert lock.replaced == held
            assert _holder(tmp_path)["slurm_job_id"] == "4242" and _holder(tmp_path)["slurm_restart_count"] == 1
            lock.release()
        else:
            with pytest.raises(RunLockError, match="on another host"):
                RunLock.acquire(tmp_path)


@pytest.mark.parametrize("text", ["", "not json\n", '{"pid": "x"}\n'])
def test_unreadable_lock_names_the_file(tmp_path, text):
    (tmp_path / ".lock").write_text(text)
    with pytest.raises(RunLockError) as e:
        RunLock.acquire(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / '.lock'} is not a lock this program can read")
    assert str(e.value).endswith(f"if no trainer uses {tmp_path}, delete {tmp_path / '.lock'}")


def test_a_late_taker_never_removes_a_fresh_lock(tmp_path, monkeypatch):
    """The race of two trainers on an abandoned lock, played in order: this one read the dead
    holder's lock, and before it removes it another trainer has removed it and taken a fresh
    one. It must leave the fresh lock and be refused by it (checked to fail when the lock
    judged gone is removed without looking again)."""
    import megatron_moe.training.run_lock as run_lock

    dead = _write_lock(tmp_path)
    fresh = _write_lock(tmp_path, host="node-elsewhere-17", pid=4321)  # replaces the dead one
    reads = iter([dead])
    real_read = run_lock._read
    monkeypatch.setattr(run_lock, "_read", lambda path: next(reads, None) or real_read(path))
    with pytest.raises(RunLockError, match="host node-elsewhere-17, pid 4321"):
        RunLock.acquire(tmp_path)
    assert _holder(tmp_path) == fresh and [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_release_leaves_another_trainers_lock(tmp_path):
    """Deleted by hand and taken by another trainer meanwhile: the old holder's release keeps it."""
    lock = RunLock.acquire(tmp_path)
    other = _write_lock(tmp_path, pid=1)
    lock.release()
    assert _holder(tmp_path) == other


_RACER = r"""
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[1])
run_lock = sys.modules["run_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
run_dir, go = Path(sys.argv[2]), Path(sys.argv[3])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.0005)
try:
    lock = run_lock.RunLock.acquire(run_dir)
except run_lock.RunLockError as e:
    print("refused", e, flush=True)
else:
    print("won", lock.replaced is not None, flush=True)
    time.sleep(3)  # hold it while the others try
    lock.release()
"""


@pytest.mark.parametrize("abandoned", [False, True])
def test_trainers_starting_at_once_one_gets_the_lock(tmp_path, abandoned):
    """8 processes try at the same moment, on a free run directory and on one whose lock a dead
    process left: exactly one gets it, the others are refused naming the winner. (Checked to
    fail with the lock created without O_EXCL, and with the abandoned lock removed without
    the breaker file.)"""
    if abandoned:
        _write_lock(tmp_path)
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(RUN_LOCK), str(tmp_path), str(go)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    for r in racers:
        assert r.stdout.readline() == "ready\n"
    go.touch()
    outs = [r.communicate(timeout=60) for r in racers]
    assert all(r.returncode == 0 for r in racers), [o[1][-2000:] for o in outs]
    lines = [o[0].strip() for o in outs]
    winners = [r.pid for r, line in zip(racers, lines) if line.startswith("won")]
    assert len(winners) == 1, lines
    if not abandoned:  # the winner of an abandoned lock may find it removed already by another
        assert lines.count("won False") == 1
    assert all(f"pid {winners[0]}," in line for line in lines if line.startswith("refused")), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go"]  # released, nothing set aside


# ----------------------------------------------------------------------------- the trainer


# every run through _hooked_train.py (no hooks unless given), on one thread; the tests check the exit status
_run = partial(run_trainer, hooks=[], check=False, timeout=300, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, small_corpus) -> Path:
    return tiny_workdir(tmp_path_factory.mktemp("lock"), small_corpus, total_chars=150_000, max_file_chars=40_000)


def _args(workdir: Path, name: str, *extra: str) -> list[str]:
    return tiny_args(workdir, name, "train.train_iters=4", "train.lr_warmup_iters=1", "train.eval_interval=0",
                     "train.save_interval=2", "train.log_interval=1", "logging.wandb=false", *extra)


def _loads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # not there yet, or partly written
        return False
    return True


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [ln for ln in stderr.splitlines() if ln.startswith("megatron-moe-train:")]


def test_second_trainer_stops_then_a_killed_holders_lock_is_taken_over(workdir):
    """A holds the run directory (paused inside its step-4 save); B, started on it, stops with one
    line naming A, writing nothing. A is killed: its lock stays, and C's --resume takes it over
    (a note), resumes from step 2 and releases it at the end."""
    run_dir = workdir / "runs" / "held"
    a = subprocess.Popen(trainer_cmd(_args(workdir, "held"), ["--pause-save", "4:120"]), cwd=REPO,
                         env=trainer_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 240
        # A pauses once its first file, the RNG states, is whole (a file still being written would
        # change under the comparison below): wait until it loads
        while not _loads(run_dir / "checkpoints" / ".tmp-iter_0000004" / "rng_rank00000.pt"):
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()
            time.sleep(0.05)
        held = _holder(run_dir)
        assert held["pid"] == a.pid and "name=held" in held["command"]
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
        b = _run(_args(workdir, "held", "--resume"))
        assert b.returncode == 1
        [line] = _error_lines(b.stderr)
        assert (f"megatron-moe-train: error: run directory {run_dir} is in use by another trainer (host "
                f"{socket.gethostname()}, pid {a.pid}, since {held['since']}): wait for it to finish") in line
        assert "another name=" in line and f"delete {run_dir / '.lock'}" in line
        assert "data:" not in b.stdout and "run held" not in b.stdout  # stopped before building
        assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before
    finally:
        a.send_signal(signal.SIGKILL)
        a.communicate(timeout=60)
    assert _holder(run_dir) == held  # a killed trainer leaves its lock
    c = _run(_args(workdir, "held", "--resume"))
    assert c.returncode == 0, c.stderr[-3000:]
    assert f"note: took over {run_dir / '.lock'} from a trainer that is gone (host {held['host']}, " \
           f"pid {a.pid}, since {held['since']})" in c.stdout
    assert "resumed from" in c.stdout and "at step 2" in c.stdout
    assert not (run_dir / ".lock").exists()


def test_every_rank_stops_when_rank_0_cannot_take_the_lock(workdir):
    """torchrun, 2 ranks, a run directory this test holds: rank 0 is refused and rank 1 learns
    it (each prints the line; without the broadcast rank 1 would go on and wait for rank 0)."""
    run_dir = workdir / "runs" / "ranks"
    lock = RunLock.acquire(run_dir)
    try:
        proc = _run(_args(workdir, "ranks"), nproc=2)
        assert proc.returncode != 0
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("megatron-moe-train: error:")]
        assert len(lines) == 2, proc.stderr[-3000:]
        assert all(f"is in use by another trainer (host {socket.gethostname()}, pid {os.getpid()}," in ln
                   for ln in lines)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"] and _holder(run_dir) == lock.holder
    finally:
        lock.release()


# ----------------------------------------------------------------------------- out of memory


def _oom_line(where: str) -> str:
    return (f"CPU out of memory {where} (tried to allocate 68719476736 bytes) with train.micro_batch_size=4: "
            "lower train.micro_batch_size (the global batch stays 8: more micro-batches are accumulated), "
            "find the largest that fits with megatron-moe-find-micro-batch, or, for a model with many or "
            "large experts, split them over more GPUs with model.moe.expert_parallel_size")


def test_out_of_memory_in_a_step_is_one_line_exit_1(workdir):
    """Through the CLI: the allocator's error in step 2 (the fault hook) ends the run with exit
    status 1 and one line; step 1 is logged, the lock is released."""
    run_dir = workdir / "runs" / "oom-cli"
    proc = _run(_args(workdir, "oom-cli"), hooks=["--oom-at-step", "2"])
    assert proc.returncode == 1
    [line] = _error_lines(proc.stderr)
    assert line == (f"megatron-moe-train: error: {_oom_line('after step 1')} "
                    "(MEGATRON_MOE_DEBUG=1 shows the traceback)")
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (run_dir / ".lock").exists()


@pytest.mark.parametrize("error, kind, tried", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                            "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, ..."),
     "CUDA", " (tried to allocate 2.00 GiB)"),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), "CUDA", ""),
    (MemoryError(), "CPU", ""),
])
def test_out_of_memory_of_each_kind_is_recognised(error, kind, tried):
    """The GPU's errors too (built here, on the CPU); their line keeps the words
    megatron-moe-find-micro-batch looks for, so its trials still count as out of memory."""
    tc = load_config(TINY).train
    line = train_mod._out_of_memory(error, tc, None)
    assert line.startswith(f"{kind} out of memory during start-up{tried} with train.micro_batch_size=8: lower")
    if kind == "CUDA":
        assert classify(1, f"megatron-moe-train: error: {line}", reached_step2=False)[0] == OOM
    assert train_mod._out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), tc, None) is None


@pytest.mark.parametrize("moments, bf16_params, per_param, freed", [
    ("fp32", True, 18, ", 1.2 GB less with train.adam_moments_dtype=bf16"),
    ("bf16", True, 14, ""),
    ("fp32", False, 16, ", 1.2 GB less with train.adam_moments_dtype=bf16"),
])
def test_a_gpus_out_of_memory_line_says_what_the_state_takes(moments, bf16_params, per_param, freed):
    """Once the model is built, the GPU's line adds the bytes its state holds before any
    activation (weights, gradients, moments, copies: counted here by hand) and what bf16
    moments would free, so a user sees whether any micro-batch can fit."""
    tc = dataclasses.replace(load_config(TINY).train, adam_moments_dtype=moments, bf16=True, bf16_params=bf16_params)
    params = [SimpleNamespace(numel=lambda: 100_000_000), SimpleNamespace(numel=lambda: 200_000_000)]
    run = SimpleNamespace(params=params, step=1)
    line = train_mod._out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), tc, run)
    assert line.startswith("CUDA out of memory after step 1 (tried to allocate 2.00 GiB) with train.micro_batch_size=8")
    assert line.endswith(f"; the model's state takes {0.3 * per_param:.1f} GB of this GPU before activations "
                         f"(0.30B parameters x {per_param} bytes: fp32 weights and gradients, AdamW's moments"
                         f"{', bf16 copies' if bf16_params else ''}){freed}")
    assert "\n" not in line
    # the CPU's allocator's line stays as it was (no GPU to speak of)
    assert ";" not in train_mod._out_of_memory(MemoryError(), tc, run).split("model.moe.expert_parallel_size")[1]


@pytest.mark.parametrize("moments, experts, total_gb, fix", [
    ("fp32", True, 80, "split the experts over more GPUs with model.moe.expert_parallel_size"),
    ("fp32", True, 100, "split the experts over more GPUs with model.moe.expert_parallel_size, or set "
                        "train.adam_moments_dtype=bf16 (84.0 GB)"),
    ("bf16", True, 80, "split the experts over more GPUs with model.moe.expert_parallel_size"),
    ("fp32", False, 100, "set train.adam_moments_dtype=bf16 (84.0 GB)"),
    ("fp32", False, 80, "this trainer shards experts only: a dense model this size needs Megatron-LM's "
                        "tensor or pipeline parallelism (docs/megatron.md)"),
])
def test_a_state_larger_than_the_gpu_is_refused_in_one_line(moments, experts, total_gb, fix):
    """6B parameters (stand-ins with numel only) x 18 bytes = 108 GB (x 14 = 84 GB with bf16 moments):
    refused before any step with the fixes that would make it fit; a GPU it fits passes."""
    tc = dataclasses.replace(load_config(TINY).train, adam_moments_dtype=moments, bf16=True, bf16_params=True)
    params = [SimpleNamespace(numel=lambda: 2_000_000_000)] * 3
    per_param = 18 if moments == "fp32" else 14
    with pytest.raises(train_mod.TrainError) as e:
        train_mod._check_state_fits(params, tc, int(total_gb * 1e9), "NVIDIA H100 80GB HBM3", experts=experts)
    assert str(e.value) == (f"the model's state takes {6 * per_param:.1f} GB of each GPU before any activation "
                            f"(6.00B parameters here x {per_param} bytes), more than the {total_gb:.1f} GB of "
                            f"the NVIDIA H100 80GB HBM3: {fix}")
    train_mod._check_state_fits(params, tc, int(6 * per_param * 1e9), "a GPU", experts=experts)  # fits: no error


@pytest.mark.parametrize("at, where", [(0, "during start-up"), (1, "in the first step")])
def test_out_of_memory_closes_the_logs_and_releases_the_lock(workdir, monkeypatch, at, where):
    """In-process: the metrics logger is closed with exit code 1 (W&B's run ends failed), and the
    lock is gone, at start-up (the model built) and in the first step."""
    closed = []
    real_close = train_mod.MetricsLogger.close

    def close(self, exit_code=0):
        closed.append(exit_code)
        real_close(self, exit_code)

    monkeypatch.setattr(train_mod.MetricsLogger, "close", close)
    monkeypatch.setattr(hooks, "raise_oom_at_step", at)
    name = f"oom-{at}"
    cfg = load_config(TINY, _args(workdir, name)[2:])
    with pytest.raises(TrainError) as e:
        pretrain(cfg)
    assert str(e.value) == _oom_line(where)
    assert closed and set(closed) == {1}
    assert not (workdir / "runs" / name / ".lock").exists()
