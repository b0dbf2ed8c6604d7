"""When things go wrong: a new user's walk through bad input, skew, faults and broken data.

    python -m pytest -q tests/training/test_faults.py          # about 1.5 minutes on 2 CPU cores

Each case ends in one clear line that names the key, file or tensor and what would be valid
(no traceback), or in a run that recovers exactly. The pieces are unit-tested elsewhere
(tests/training/test_run_config.py, test_model.py, test_layer.py, test_data.py, test_train.py); here
they are driven end to end the way a user meets them, mostly through the
``megatron-moe-train`` CLI, plus what only this file tests:

  * non-finite steps: skipped (weights and optimizer state untouched), counted in
    ``skipped_steps``, the run stops after ``train.max_consecutive_nonfinite`` in a row, and
    the counters survive a resume (poisoned through the fault hook ``loss_factor_at_step``);
  * SIGKILL at any moment, mid-step or mid-checkpoint-write (the fault hook ``pause_save``
    holds a save open), then ``--resume``: no half-written checkpoint is loaded, at most the
    steps since the last complete checkpoint are lost, and the losses equal a straight run's;
  * ``train.deterministic``: two runs with one seed give identical losses;
  * ``MEGATRON_MOE_CHECK_FINITE=1``: the layer refuses NaN/Inf input;
  * truncated / corrupt / mixed-up .bin/.idx pairs and foreign token ids stop before training;
  * ffn_hidden_size not a multiple of block_size (supported, equal to a float64 loop);
  * GPU only (marked ``gpu``): tokens*top_k*hidden > 2^31 through the grouped and blocksparse
    paths, and bounded memory over 20 steps of heavily skewed routing.

Skewed routing on the CPU (all tokens to one expert, all experts empty but one, top_k =
num_experts, capacity drops exactly the overflow) is tested in tests/layer/test_layer.py. Here: a
float64 input to a Triton path names the layer input, and zero tokens go through the
block-sparse CPU fallback (an expert-parallel rank may receive none).

Training runs use the tiny-cpu config shrunk as in tests/training/test_train.py (seq 64, global batch
8, a 512-piece tokenizer on ~150 KB of stdlib sources), without W&B.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_moe import DroplessMoE, MoEConfig
from megatron_moe.training.data import DataConfig, build_datasets, prepare_data
from megatron_moe.training.run_config import load_config
from megatron_moe.training.distributed import set_deterministic
from megatron_moe.training.train import main

sys.path.insert(0, str(Path(__file__).parent))
from _trainer import (REPO, TINY, read_metrics, run_trainer, tiny_args, tiny_workdir,  # noqa: E402
                      trainer_cmd, trainer_env)

STEPS = 16
SAVE = 4


# ----------------------------------------------------------------------------- helpers


_run = partial(run_trainer, timeout=300, OMP_NUM_THREADS="1")  # every run on one thread
_metrics = partial(read_metrics, tolerant=True)  # runs are watched while they write, and killed


def _one_error_line(stderr: str, *needles: str) -> str:
    """The CLI's error: one 'megatron-moe-train: ... error: ...' line holding every needle, and
    no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megatron-moe-train:")]
    assert len(lines) == 1, stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _latest(run_dir: Path) -> str | None:
    p = run_dir / "checkpoints" / "latest"
    return p.read_text().strip() if p.exists() else None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, small_corpus) -> Path:
    """A small corpus (stdlib sources, ~150 KB) and the directories the runs share."""
    return tiny_workdir(tmp_path_factory.mktemp("faults"), small_corpus, total_chars=150_000, max_file_chars=40_000)


def _args(workdir: Path, name: str, *extra: str) -> list[str]:
    return tiny_args(workdir, name, f"train.train_iters={STEPS}", "train.lr_warmup_iters=4", "train.lr=3e-3",
                     "train.min_lr=3e-4", "train.eval_interval=0", f"train.save_interval={SAVE}",
                     "train.log_interval=1", "train.deterministic=true", "logging.wandb=false", *extra)


@pytest.fixture(scope="module")
def straight(workdir) -> list[float]:
    """The reference: STEPS steps straight through (deterministic mode); its LM losses."""
    out = _run(_args(workdir, "straight"))
    assert "deterministic" in out.stdout
    rows = _metrics(workdir / "runs" / "straight")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["skipped_steps"] == 0 for r in rows)
    return [r["lm_loss"] for r in rows]


# ----------------------------------------------------------------------------- 1. bad configs


@pytest.mark.parametrize("override, needles", [
    # wrong types
    ("train.lr=fast", ["train.lr='fast' has the wrong type", "expected a number"]),
    ("model.moe.top_k=2.5", ["model.moe.top_k=2.5 has the wrong type", "expected an int"]),
    ("train.deterministic=maybe", ["train.deterministic='maybe'", "true or false"]),
    # negative or zero sizes
    ("model.hidden_size=-128", ["model.hidden_size=-128", "positive"]),
    ("model.moe.num_experts=0", ["model.moe.num_experts=0", "positive"]),
    ("train.micro_batch_size=0", ["train.micro_batch_size=0", ">= 1"]),
    ("train.max_consecutive_nonfinite=0", ["train.max_consecutive_nonfinite=0", ">= 1"]),
    # top_k > num_experts; experts not divisible by the expert-parallel size
    ("model.moe.top_k=9", ["model.moe.top_k=9", "1 <= top_k <= num_experts (8)"]),
    ("model.moe.expert_parallel_size=3",
     ["model.moe.expert_parallel_size=3", "divisor of model.moe.num_experts (8)"]),
    # a block size the kernels do not have
    ("model.moe.block_size=100", ["model.moe.block_size=100", "16, 32, 64, 128, 256"]),
    # unknown keys, with a "did you mean"
    ("train.lr_warmup_iter=5", ["train.lr_warmup_iter", "did you mean", "train.lr_warmup_iters"]),
    ("model.moe.num_expert=4", ["model.moe.num_expert", "did you mean", "model.moe.num_experts"]),
    ("trian.lr=1e-3", ["trian", "did you mean", "train"]),
])
def test_bad_config_is_one_line_naming_the_key(override, needles, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", str(TINY), override, "--print-config"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    _one_error_line(err, "config error", *needles)


def test_cli_subprocess_bad_config_has_no_traceback():
    """The same as a user sees it: a real process, exit status 2, one line on stderr."""
    proc = _run(["--config", str(TINY), "model.moe.top_k=9"], check=False, timeout=120)
    assert proc.returncode == 2
    _one_error_line(proc.stderr, "model.moe.top_k=9", "num_experts (8)")


# ----------------------------------------------------------------------------- 1. bad layer input


def _layer(impl="triton_grouped", **kw):
    base = dict(hidden_size=32, ffn_hidden_size=40, num_experts=4, top_k=2, block_size=16,
                mlp_impl=impl, aux_loss_coeff=0.0)
    base.update(kw)
    torch.manual_seed(0)
    layer = DroplessMoE(MoEConfig(**base))
    with torch.no_grad():
        layer.experts.w1.normal_(0, 0.3)
        layer.experts.w2.normal_(0, 0.3)
        layer.router.weight.normal_(0, 1.0)
    return layer


def test_wrong_input_shape_and_dtype_name_the_tensor():
    layer = _layer()
    with pytest.raises(ValueError, match=r"DroplessMoE input x has shape \(4, 31\): expected "
                                         r"\[tokens, 32\] or \[seq, batch, 32\]"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match=r"DroplessMoE input x has dtype torch\.int64: expected "
                                         r"a floating-point"):
        layer(torch.ones(4, 32, dtype=torch.long))
    with pytest.raises(TypeError, match="DroplessMoE input: expected a torch.Tensor, got list"):
        layer([[0.0] * 32])


def test_float64_input_to_grouped_names_the_layer_input():
    with pytest.raises(ValueError, match=r"DroplessMoE input x"):
        _layer("triton_grouped")(torch.randn(5, 32, dtype=torch.float64))


def test_zero_tokens_through_blocksparse_cpu_fallback(monkeypatch):
    layer = _layer("blocksparse")
    layer(torch.randn(3, 32))  # imports the kernels while TRITON_INTERPRET=1 (set at decoration)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the path a CPU training run takes
    y = layer(torch.randn(0, 32))
    assert y.shape == (0, 32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_check_finite_switch_names_the_count(bad, monkeypatch):
    layer = _layer()
    x = torch.randn(6, 32)
    x[2, 5] = bad
    x[4, 0] = bad
    # off by default: the forward runs, and the bad token's output is not finite
    assert DroplessMoE.check_finite is False
    y = layer(x)
    assert not torch.isfinite(y[2]).all() and torch.isfinite(y[[0, 1, 3, 5]]).all()
    monkeypatch.setattr(DroplessMoE, "check_finite", True)
    with pytest.raises(ValueError, match=r"DroplessMoE input x has 2 non-finite values "
                                         r"\(NaN/Inf\) of 192 \(shape \(6, 32\)\)"):
        layer(x)
    torch.testing.assert_close(layer(x.nan_to_num(0.0, 0.0, 0.0)),
                               _layer()(x.nan_to_num(0.0, 0.0, 0.0)))  # finite input: unchanged


def test_check_finite_environment_variable_is_read_at_import():
    code = ("import torch\nfrom megatron_moe import DroplessMoE, MoEConfig\n"
            "l = DroplessMoE(MoEConfig(hidden_size=8, ffn_hidden_size=16))\n"
            "x = torch.randn(3, 8); x[1, 1] = float('nan')\n"
            "print('switch', DroplessMoE.check_finite)\n"
            "try:\n    l(x); print('no error')\n"
            "except ValueError as e:\n    print('error:', e)\n")
    for value, want in (("1", "error: DroplessMoE input x has 1 non-finite values"),
                        ("0", "no error")):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                             text=True, timeout=120,
                             env=trainer_env(OMP_NUM_THREADS="1", MEGATRON_MOE_CHECK_FINITE=value)).stdout
        assert f"switch {value == '1'}" in out and want in out, out


# ----------------------------------------------------------------------------- 2. skew and size (CPU)


def _loop_reference(x, layer):
    """float64, one token at a time (independent of the layer's dispatch)."""
    cfg = layer.cfg
    x = x.detach().double()
    r, w1, w2 = (t.detach().double() for t in (layer.router.weight, layer.experts.w1,
                                                layer.experts.w2))
    out = []
    for t in range(x.shape[0]):
        scores = torch.softmax(r @ x[t], 0)
        ids = torch.topk(scores, cfg.top_k).indices
        y = torch.zeros_like(x[t])
        for e in ids:
            h = x[t] @ w1[e]
            a = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
            y = y + scores[e] * (a @ w2[e])
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("impl", ["blocksparse", "triton_grouped", "reference"])
def test_ffn_not_a_multiple_of_the_block_size_is_supported(impl):
    """F = 40 with block 16: the block-sparse path pads the last column block; the result equals
    the float64 loop (conftest runs the Triton kernels under the interpreter on the CPU)."""
    layer = _layer(impl, ffn_hidden_size=40, block_size=16)
    x = torch.randn(21, 32)
    got = layer(x)
    want = _loop_reference(x, layer)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


# ----------------------------------------------------------------------------- 3. non-finite steps


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(workdir):
    """Steps 3 (NaN) and 4 (Inf) poisoned: both skipped with the weights and optimizer state
    untouched (the step-4 checkpoint equals the step-2 one, byte for byte in every tensor),
    skipped_steps counts them; the counters are in the checkpoint, so after --resume a third
    non-finite step in a row (step 5) stops the run with train.max_consecutive_nonfinite=3."""
    args = _args(workdir, "nan", "train.save_interval=2", "train.max_consecutive_nonfinite=3")
    run_dir = workdir / "runs" / "nan"
    out = _run(args + ["train.exit_interval=4"], hooks=["--loss-factor", "3,4:inf"])
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 2]
    assert rows[2]["lm_loss"] is None and rows[3]["lm_loss"] is None  # NaN/Inf -> null
    assert rows[0]["lm_loss"] > 0 and rows[1]["lm_loss"] > 0
    assert "step 3: non-finite lm_loss nan" in out.stdout
    assert "step 4: non-finite lm_loss inf" in out.stdout and "2 in a row" in out.stdout
    ck = run_dir / "checkpoints"
    for f in ("model.pt", "optimizer.pt"):
        a = torch.load(ck / "iter_0000002" / f, weights_only=True)
        b = torch.load(ck / "iter_0000004" / f, weights_only=True)
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert len(flat_a) > 10 and flat_a.keys() == flat_b.keys()
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), f
    meta = json.loads((ck / "iter_0000004" / "meta.json").read_text())
    assert meta["skipped_steps"] == 2 and meta["consecutive_nonfinite"] == 2
    assert meta["consumed_samples"] == 4 * 8  # skipped steps still consume their data

    proc = _run(args + ["--resume"], check=False, hooks=["--loss-factor", "5"])
    assert proc.returncode == 1
    _one_error_line(proc.stderr, "3 steps in a row (3..5)", "non-finite LM loss",
                    "train.max_consecutive_nonfinite=3", "Lower train.lr",
                    "--resume from the last checkpoint (iter_0000004)")
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[4]["skipped_steps"] == 3
    assert _latest(run_dir) == "iter_0000004"


def _tensors(obj, prefix="") -> dict:
    """Every tensor in a nested state dict, by path."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


# ----------------------------------------------------------------------------- 3. kill and resume


def _start(args: list[str], hooks: list[str] | None = None, **env) -> subprocess.Popen:
    return subprocess.Popen(trainer_cmd(args, hooks), cwd=REPO, env=trainer_env(OMP_NUM_THREADS="1", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen | list[subprocess.Popen], cond, timeout: float = 240.0) -> None:
    """Until ``cond()``; a run (any rank of a list) that ends before then fails the test with its output."""
    procs = proc if isinstance(proc, list) else [proc]
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                for q in procs:
                    q.kill()
                raise AssertionError(f"the run ended (rc {p.returncode}) before the moment to kill "
                                     f"it:\n{out[-2000:]}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError("timed out waiting for the moment to kill the run")
        time.sleep(0.002)


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _resume_and_compare(workdir, name: str, straight: list[float], expect_from: set[int]) -> int:
    out = _run(_args(workdir, name, "--resume"))
    resumed = [ln for ln in out.stdout.splitlines() if ln.startswith("resumed from")]
    assert len(resumed) == 1, out.stdout[-2000:]
    step = int(resumed[0].split(" at step ")[1].split()[0])
    assert step in expect_from, (step, expect_from, resumed[0])
    rows = _metrics(workdir / "runs" / name)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # deterministic mode: the resumed run's losses are the straight run's, bit for bit
    assert [r["lm_loss"] for r in rows] == straight
    assert not list((workdir / "runs" / name / "checkpoints").glob(".tmp-*"))
    return step


def test_a_nonfinite_step_under_cuda_graphs_is_skipped_like_an_eager_one(workdir):
    """Step 2 poisoned (NaN) with train.cuda_graphs=micro_batch (the CPU stand-in for the graph;
    the poison goes in through the graph's static inputs): skipped, and the steps after it have
    the eager run's losses, every digit (the poisoned gradients zeroed in place, not freed)."""
    rows = {}
    for mode in ("none", "micro_batch"):
        args = _args(workdir, f"nan-graph-{mode}", "train.train_iters=4", "train.save_final=false",
                     f"train.cuda_graphs={mode}")
        _run(args, hooks=["--loss-factor", "2", "--cuda-graphs-on-cpu"])
        rows[mode] = _metrics(workdir / "runs" / f"nan-graph-{mode}")
    assert [r["skipped_steps"] for r in rows["micro_batch"]] == [0, 1, 1, 1]
    assert [r["lm_loss"] for r in rows["micro_batch"]] == [r["lm_loss"] for r in rows["none"]]
    assert rows["micro_batch"][1]["lm_loss"] is None and rows["micro_batch"][3]["lm_loss"] > 0


def test_kill_mid_step_then_resume_loses_at_most_the_steps_since_the_checkpoint(workdir, straight):
    """SIGKILL as soon as step 6 is logged (so during step 7, or a little later: wherever the
    run is); --resume restarts from the last complete checkpoint. The steps logged before the
    kill, a second run with the same seed, equal the straight run's exactly
    (train.deterministic)."""
    name = "kill-step"
    run_dir = workdir / "runs" / name
    proc = _start(_args(workdir, name))
    _wait_for(proc, lambda: len(_metrics(run_dir)) >= 6)
    _kill(proc)
    done = len(_metrics(run_dir))  # steps finished before the kill
    before = [r["lm_loss"] for r in _metrics(run_dir)]
    assert 6 <= done < STEPS and before == straight[:done]
    last_complete = (done // SAVE) * SAVE
    # killed inside the save of step `done` (logged, not yet saved): the previous one counts
    expect = {last_complete, last_complete - SAVE} if done % SAVE == 0 else {last_complete}
    step = _resume_and_compare(workdir, name, straight, expect)
    assert done - step <= SAVE


def test_kill_mid_checkpoint_write_never_loads_it(workdir, straight):
    """The save of step 8 is held open after its first file: SIGKILL then leaves a
    .tmp-iter_0000008 folder and `latest` at iter_0000004; --resume starts from step 4."""
    name = "kill-save"
    run_dir = workdir / "runs" / name
    ck = run_dir / "checkpoints"
    proc = _start(_args(workdir, name), hooks=["--pause-save", "8:60"])
    _wait_for(proc, lambda: any(ck.glob(".tmp-iter_0000008/rng_rank*.pt")))
    _kill(proc)
    assert (ck / ".tmp-iter_0000008").is_dir() and not (ck / "iter_0000008").exists()
    assert _latest(run_dir) == "iter_0000004"
    assert len(_metrics(run_dir)) == 8  # step 8 ran and was logged; its save was cut
    _resume_and_compare(workdir, name, straight, {4})
    assert _latest(run_dir) == f"iter_{STEPS:07d}" and (ck / "iter_0000008").is_dir()


def test_sigterm_saves_after_the_step_and_resume_continues_exactly(workdir, straight):
    """SIGTERM (Slurm's time limit or preemption) once step 5 is logged: the run finishes the
    step it is in, saves it, says so and exits 0, its lock released; --resume continues from that
    step with the straight run's losses, bit for bit."""
    name = "sigterm"
    run_dir = workdir / "runs" / name
    proc = _start(_args(workdir, name))
    _wait_for(proc, lambda: len(_metrics(run_dir)) >= 5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    done = len(_metrics(run_dir))
    assert 5 <= done < STEPS
    assert f"SIGTERM received: stopped after step {done}, checkpoint saved" in out, out[-2000:]
    assert _latest(run_dir) == f"iter_{done:07d}" and not (run_dir / ".lock").exists()
    _resume_and_compare(workdir, name, straight, {done})


def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_same_step(workdir):
    """Two processes (gloo, on the CPU also on a GPU machine, which may have one GPU); SIGUSR1
    reaches rank 1 alone: both ranks stop after the same step (the ranks agree on it), the
    checkpoint of that step is complete and both exit 0."""
    from _util import free_port

    name = "sigusr1-2ranks"
    run_dir = workdir / "runs" / name
    port = str(free_port())
    procs = [subprocess.Popen(trainer_cmd(_args(workdir, name)), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=trainer_env(OMP_NUM_THREADS="1", RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                              CUDA_VISIBLE_DEVICES=""))
             for r in range(2)]
    _wait_for(procs, lambda: len(_metrics(run_dir)) >= 3)
    procs[1].send_signal(signal.SIGUSR1)
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    done = len(_metrics(run_dir))
    assert 3 <= done < STEPS
    assert f"SIGUSR1 received: stopped after step {done}, checkpoint saved" in outs[0][0], outs[0][0][-2000:]
    ckpt = run_dir / "checkpoints" / f"iter_{done:07d}"
    assert _latest(run_dir) == ckpt.name and sorted(p.name for p in ckpt.glob("rng_rank*.pt")) == \
        ["rng_rank00000.pt", "rng_rank00001.pt"]


def test_half_written_checkpoint_named_by_latest_is_refused_in_one_line(workdir, straight):
    """If `latest` names an incomplete checkpoint (a file cut short by a disk failure), --resume
    says so, naming the file and what to do, instead of loading it."""
    src = workdir / "runs" / "straight"
    dst = workdir / "runs" / "torn"
    shutil.copytree(src, dst)
    model = dst / "checkpoints" / _latest(dst) / "model.pt"
    with open(model, "r+b") as f:
        f.truncate(model.stat().st_size // 2)
    proc = _run(_args(workdir, "torn", "--resume"), check=False)
    assert proc.returncode == 1
    _one_error_line(proc.stderr, "is incomplete: model.pt has", "the manifest says")


def test_deterministic_switch_sets_torch_state(monkeypatch):
    """train.deterministic=true: deterministic algorithms, cuDNN without benchmarking, and the
    cuBLAS / NCCL settings (unless the user set them); false leaves everything alone."""
    for var in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO"):
        monkeypatch.delenv(var, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    try:
        set_deterministic(False)
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark) == before
        monkeypatch.setenv("NCCL_ALGO", "Tree")  # the user's choice is kept
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["NCCL_ALGO"] == "Tree"
        assert load_config(TINY).train.deterministic is False  # off by default
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


# ----------------------------------------------------------------------------- 4. data


@pytest.fixture(scope="module")
def prepared(workdir):
    """The corpus prepared once (the same cache the training runs use)."""
    cfg = load_config(TINY, _args(workdir, "x")[2:])  # the overrides after --config TINY
    return cfg.data, prepare_data(cfg.data)


def _copy_pair(prepared, dst: Path) -> str:
    _, prep = prepared
    dst.mkdir(parents=True, exist_ok=True)
    prefix = str(dst / "data")
    for ext in (".bin", ".idx"):
        shutil.copyfile(prep.prefix + ext, prefix + ext)
    return prefix


def _build(data_cfg, prep, vocab=512):
    return build_datasets(data_cfg, prep, seq_length=64, seed=1, num_samples=(8, 8, 0),
                          model_vocab_size=vocab)


def _idx_counts(prefix: str) -> tuple[int, int]:
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    return struct.unpack("<QQ", head[18:34])


@pytest.mark.parametrize("damage, needles", [
    ("truncate_bin", [".bin has", "bytes but", "describes", "truncated"]),
    ("extend_bin", [".bin has", "bytes but", "from different builds"]),
    ("truncate_idx", [".idx has", "needs", "truncated or corrupt"]),
    ("garbage_idx", [".idx is not a megatron-core index file"]),
    ("bad_dtype_idx", ["unknown version", "token dtype code (99)"]),
])
def test_corrupt_or_truncated_pair_is_refused_before_training(prepared, tmp_path, damage, needles):
    data_cfg, prep = prepared
    prefix = _copy_pair(prepared, tmp_path / "copy")
    cfg = DataConfig(data_prefix=prefix, tokenizer_model=prep.tokenizer_path,
                     cache_dir=str(tmp_path / "c"))
    assert prepare_data(cfg).num_tokens == prep.num_tokens  # the intact copy is accepted
    bin_size = os.path.getsize(prefix + ".bin")
    if damage == "truncate_bin":
        os.truncate(prefix + ".bin", bin_size - 100)
    elif damage == "extend_bin":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\x00\x00" * 10)
    elif damage == "truncate_idx":
        os.truncate(prefix + ".idx", os.path.getsize(prefix + ".idx") - 8)
    elif damage == "garbage_idx":
        Path(prefix + ".idx").write_bytes(os.urandom(300))
    else:
        with open(prefix + ".idx", "r+b") as f:
            f.seek(17)
            f.write(bytes([99]))
    with pytest.raises(ValueError) as e:
        prepare_data(cfg)
    msg = str(e.value)
    assert msg.startswith(f"data.data_prefix: {prefix}") and "\n" not in msg
    assert all(n in msg for n in needles), msg
    assert "megatron-moe-prepare-data" in msg  # the fix


def test_corrupt_prepared_cache_names_the_directory_to_delete(prepared, tmp_path):
    """The cache under data.cache_dir damaged after it was built: build_datasets says which
    directory to delete (it is rebuilt from data.paths on the next run)."""
    data_cfg, prep = prepared
    import dataclasses

    prefix = _copy_pair(prepared, tmp_path / "stdlib-0123")
    copy = dataclasses.replace(prep, prefix=prefix)
    with open(prefix + ".bin", "r+b") as f:  # a flipped token near the end: id 40000 >= 512
        f.seek(os.path.getsize(prefix + ".bin") - 6)
        f.write(struct.pack("<H", 40000))
    with pytest.raises(ValueError, match=r"prepared data: .*data\.bin holds token id 40000 but the "
                                         r"tokenizer .* has only 512: .*delete .*stdlib-0123"):
        _build(data_cfg, copy)
    os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") - 2)
    with pytest.raises(ValueError, match=r"prepared data: .*data\.bin has \d+ bytes but .*data\.idx "
                                         r"describes \d+.*delete .*stdlib-0123 and run again"):
        _build(data_cfg, copy)


def test_pair_from_another_build_is_refused(prepared, tmp_path):
    """An .idx of another corpus next to this .bin: the sizes disagree."""
    _, prep = prepared
    prefix = _copy_pair(prepared, tmp_path / "mixed")
    other = tmp_path / "other.txt"
    other.write_text("a different corpus\n" * 200)
    p2 = prepare_data(DataConfig(paths=[str(other)], tokenizer_model=prep.tokenizer_path,
                                 cache_dir=str(tmp_path / "c2")))
    shutil.copyfile(p2.prefix + ".idx", prefix + ".idx")
    assert _idx_counts(prefix) != _idx_counts(prep.prefix)
    with pytest.raises(ValueError, match=r"data\.data_prefix: .*mixed/data\.bin has \d+ bytes but "
                                         r".*from different builds"):
        prepare_data(DataConfig(data_prefix=prefix, tokenizer_model=prep.tokenizer_path))


def test_cli_data_errors_stop_before_training(workdir, prepared, tmp_path):
    """Through the CLI: a truncated data_prefix, a tokenizer that does not match the data, a
    model vocabulary smaller than the tokenizer, and an empty split each stop with one line
    before the first step (no metrics, no checkpoint)."""
    _, prep = prepared
    prefix = _copy_pair(prepared, tmp_path / "cli")
    os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") - 64)
    # a 400-piece tokenizer: the data's ids (made with 512 pieces) go past its vocabulary
    other_tok = prepare_data(DataConfig(paths=[str(workdir / "corpus")], tokenizer_vocab_size=400,
                                        cache_dir=str(tmp_path / "c3"))).tokenizer_path
    intact = _copy_pair(prepared, tmp_path / "intact")
    one = tmp_path / "one.txt"
    one.write_text("a single short document\n")
    cases = [
        (["data.paths=[]", f"data.data_prefix={prefix}", f"data.tokenizer_model={prep.tokenizer_path}"],
         ["data.data_prefix:", "data.bin has", "truncated"]),
        (["data.paths=[]", f"data.data_prefix={intact}", f"data.tokenizer_model={other_tok}"],
         ["data.data_prefix:", "holds token id", "has only 400", "another tokenizer"]),
        (["model.vocab_size=384"], ["model.vocab_size=384 is smaller than the tokenizer's "
                                    "vocabulary (512 tokens"]),
        ([f"data.paths=[{one}]", f"data.tokenizer_model={prep.tokenizer_path}",
          "data.split='969,30,1'"], ["data.split='969,30,1' leaves the valid split without "
                                     "sequences"]),
    ]
    for i, (extra, needles) in enumerate(cases):
        name = f"baddata{i}"
        proc = _run(_args(workdir, name, *extra), check=False, timeout=180)
        assert proc.returncode == 1, (extra, proc.stdout[-1000:], proc.stderr[-2000:])
        _one_error_line(proc.stderr, *needles)
        assert not _metrics(workdir / "runs" / name) and _latest(workdir / "runs" / name) is None


# ----------------------------------------------------------------------------- 2. GPU only


def _rows_reference(x_S, layer, dy_S):
    """float32 reference for a sample of tokens: router, top-k, experts; y and dx by autograd.
    Each token's output depends on its own input alone (aux_loss_coeff = 0), so a sample of rows
    checks the whole layer's rows at those positions."""
    cfg = layer.cfg
    x = x_S.detach().float().requires_grad_(True)
    r = layer.router.weight.detach().float()
    w1, w2 = layer.experts.w1.detach().float(), layer.experts.w2.detach().float()
    scores = torch.softmax(x @ r.t(), -1)
    w, ids = torch.topk(scores, cfg.top_k, dim=-1)
    h = torch.einsum("sh,skhf->skf", x, w1[ids])
    a = torch.nn.functional.gelu(h, approximate="tanh")
    y = torch.einsum("skf,skfh,sk->sh", a, w2[ids], w)
    (y * dy_S.float()).sum().backward()
    return y.detach(), x.grad


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton_grouped", "blocksparse"])
def test_more_than_2_31_elements(impl):
    """T = 2^21 + 4096 tokens, top-2, H = 1024, bf16: x alone holds > 2^31 elements and the
    permuted rows (T*K*H) 2^32 + ...; every int32 offset would wrap. A sample of rows (spread
    over the whole range, with the last ones) is checked, forward and dx, against float32."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    T, H, F, E, K = (1 << 21) + 4096, 1024, 64, 8, 2
    assert T * H > 2 ** 31 and T * K * H > 2 ** 32
    layer = DroplessMoE(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K,
                                  mlp_impl=impl, aux_loss_coeff=0.0, block_size=128)).to(dev)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    y = layer(x)
    assert y.shape == (T, H) and y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    sample = torch.cat([torch.randint(0, T, (192,), device=dev),
                        torch.arange(T - 64, T, device=dev)])
    y_ref, dx_ref = _rows_reference(x.detach()[sample], layer, dy[sample])

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(y.detach()[sample], y_ref) < 2e-2
    assert rel(x.grad[sample], dx_ref) < 3e-2
    assert torch.isfinite(x.grad[-64:]).all() and x.grad[-64:].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton_grouped", "blocksparse"])
def test_memory_bounded_under_heavy_skew(impl):
    """20 training steps where every token's two choices go to the same two experts (a
    different pair each step; the other 14 are empty): launches are sized by the dropless
    upper bound, so the peak after step 5 is the peak after step 20 and nothing accumulates
    between steps."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    T, H, F, E, K = 16384, 512, 1024, 16, 2
    layer = DroplessMoE(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K,
                                  mlp_impl=impl, aux_loss_coeff=0.01)).to(dev)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    base = torch.randn(T, H, device=dev)
    peaks, current = {}, {}
    for step in range(1, 21):
        hot = step % E
        with torch.no_grad():  # x > 0: every token picks `hot`, then `hot + 1`
            layer.router.weight.zero_()
            layer.router.weight[hot] = 1.0
            layer.router.weight[(hot + 1) % E] = 0.5
        x = (base.abs() + 0.1).requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        (y.float().square().mean() + layer.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts = layer.tokens_per_expert
        assert counts[hot].item() == T and counts.sum().item() == T * K
        torch.cuda.synchronize()
        peaks[step] = torch.cuda.max_memory_allocated(dev)
        current[step] = torch.cuda.memory_allocated(dev)
        del x, y
    assert peaks[20] <= peaks[5] * 1.02 + (1 << 20), peaks
    assert max(current[s] for s in range(5, 21)) - min(current[s] for s in range(5, 21)) \
        <= (1 << 20), current
