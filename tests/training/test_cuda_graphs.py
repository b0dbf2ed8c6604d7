"""train.cuda_graphs: the micro-batch graph's bookkeeping on the CPU, the trainer with it on the GPU.

    pytest tests/training/test_cuda_graphs.py -q

On the CPU, cuda_graphs.EagerReplay stands in for the graph (it re-runs the captured step and
copies its result into the static output), so what is tested here is everything around the
capture: static inputs and output, gradients that exist before the capture and are added into,
the warm-up's effects undone, the checks that refuse what a graph cannot hold. The end-to-end
runs with and without it are in test_train.py (the same losses, every digit); the GPU test
below compares real replays with eager steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_moe import MoEConfig
from megatron_moe.training.cuda_graphs import EagerReplay, MicroBatchGraph, check_supported, resolve_mode
from megatron_moe.training.run_config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


class _Counter(EagerReplay):
    def __init__(self):
        self.warmups = self.captures = self.replays = 0
        self.released, self.shared = [], []

    def warmup(self, fn, n):
        self.warmups += n
        super().warmup(fn, n)

    def capture(self, fn, share=None):
        self.captures += 1
        self.shared.append(share)
        return super().capture(fn, share)

    def replay(self, graph, out):
        self.replays += 1
        super().replay(graph, out)

    def release(self, graph, wait):
        self.released.append((graph, wait))


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    m.register_buffer("seen", torch.zeros(()))  # state the step changes in place
    return m


def _step(model):
    def step(batch):
        model.seen += batch["x"].shape[0]
        y = model(batch["x"])
        loss = ((y - batch["t"]) ** 2).mean()
        loss.backward()
        noise = torch.rand(())  # the RNG's position: the warm-up must not move it
        return torch.stack([loss.detach(), noise])
    return step


def test_replays_equal_the_eager_steps_and_the_warmup_leaves_no_trace():
    """Four micro-batches through the graph stand-in: the same output tensor each time (the
    static output), the same losses, gradients (float64 sums of the eager steps), buffers and
    RNG stream as four plain steps; two warm-up passes and one capture happened."""
    batches = [{"x": torch.randn(4, 6), "t": torch.randn(4, 3)} for _ in range(4)]
    ref, got = _model(), _model()
    torch.manual_seed(5)
    want = [_step(ref)(b) for b in batches]
    grads_ref = [p.grad.double() for p in ref.parameters()]

    backend = _Counter()
    captured = []
    graph = MicroBatchGraph(_step(got), grads=list(got.parameters()), state=list(got.buffers()),
                            backend=backend, on_capture=captured.append)
    torch.manual_seed(5)
    outs = []
    for b in batches:
        out = graph(b)
        outs.append(out.clone())
        assert out is graph.out
    assert (backend.warmups, backend.captures, backend.replays) == (2, 1, 4)
    assert captured == [graph] and graph.warmup_s >= 0 and graph.capture_s >= 0
    for w, o in zip(want, outs):
        assert torch.equal(w, o)
    for p, g in zip(got.parameters(), grads_ref):
        assert torch.allclose(p.grad.double(), g, rtol=1e-6, atol=1e-7)
    assert got.seen.item() == ref.seen.item() == 16


def test_inputs_are_copied_into_the_static_buffers():
    """After the capture the graph reads its own buffers: a later batch is copied in, and
    changing the caller's tensor afterwards changes nothing."""
    m = _model()
    graph = MicroBatchGraph(_step(m), grads=list(m.parameters()), state=[], backend=EagerReplay())
    first = {"x": torch.randn(4, 6), "t": torch.randn(4, 3)}
    graph(first)
    assert graph.static["x"] is not first["x"] and torch.equal(graph.static["x"], first["x"])
    second = {"x": torch.randn(4, 6), "t": torch.randn(4, 3)}
    graph(second)
    assert torch.equal(graph.static["x"], second["x"])
    second["x"].zero_()
    assert not torch.equal(graph.static["x"], second["x"])


def test_gradients_exist_before_the_capture_and_are_added_into():
    """No .grad yet: the capture makes zero ones (a graph needs their addresses); the steps add
    into those same tensors, which the trainer zeroes in place between optimizer steps."""
    m = _model()
    assert all(p.grad is None for p in m.parameters())
    graph = MicroBatchGraph(_step(m), grads=list(m.parameters()), state=[], backend=EagerReplay())
    b = {"x": torch.randn(4, 6), "t": torch.randn(4, 3)}
    graph(b)
    ids = [id(p.grad) for p in m.parameters()]
    one = [p.grad.clone() for p in m.parameters()]
    graph(b)
    assert [id(p.grad) for p in m.parameters()] == ids
    for p, g in zip(m.parameters(), one):
        assert torch.allclose(p.grad, 2 * g)
    m.zero_grad(set_to_none=True)  # the graph would write into freed memory: refused
    with pytest.raises(RuntimeError, match=r"a gradient the graph adds into was freed or replaced"):
        graph(b)


def _sink_step(masters, skip=()):
    """A step that hands each master a 'gradient' (a function of the batch) through its
    MasterGrad, as the experts' kernels and the bf16 copies' hook do: written or added into as
    the sink says; masters whose index is in ``skip`` get none."""
    from megatron_moe.ops.master_grad import MasterGrad

    def step(batch):
        for i, m in enumerate(masters):
            if i in skip:
                continue
            out, add = MasterGrad(m).buffer()
            g = batch["x"][i] * torch.arange(1.0, m.numel() + 1).reshape(m.shape)
            out.add_(g) if add else out.copy_(g)
        return batch["x"].sum().reshape(1)
    return step


def test_a_first_micro_batch_that_overwrites_needs_no_zeroing():
    """With ``overwriting`` the step is captured twice (the second sharing the first's pool);
    ``first=True`` replays the overwriting capture: three steps of two micro-batches with no
    zeroing in between leave each step's own sum, as eager steps with fresh gradients do."""
    from megatron_moe.ops.master_grad import overwriting

    masters = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    backend = _Counter()
    graph = MicroBatchGraph(_sink_step(masters), grads=masters, state=[], backend=backend, overwriting=overwriting)
    assert graph.overwrites
    for step in range(3):
        xs = [torch.randn(2) for _ in range(2)]
        for micro, x in enumerate(xs):
            graph({"x": x}, first=micro == 0)
        for i, m in enumerate(masters):
            want = (xs[0][i] + xs[1][i]) * torch.arange(1.0, m.numel() + 1).reshape(m.shape)
            torch.testing.assert_close(m.grad, want, rtol=1e-6, atol=1e-6)
    assert graph.overwrites and graph.no_overwrite is None
    assert (backend.warmups, backend.captures, backend.replays) == (3, 2, 6)
    assert backend.shared == [None, graph.graph]  # the overwriting capture shares the first's pool
    first, rest = graph.first_graph, graph.graph
    graph.release()
    assert backend.released == [(first, True), (rest, False)]  # one wait for both


def test_a_gradient_left_unwritten_keeps_the_zeroing():
    """A master the step does not write (here the second) would keep the last step's gradient:
    the NaN-filled check pass finds it, and the graph adds into zeroed gradients instead (one
    capture, ``overwrites`` False, the reason kept for the trainer's line)."""
    from megatron_moe.ops.master_grad import overwriting

    masters = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    backend = _Counter()
    graph = MicroBatchGraph(_sink_step(masters, skip={1}), grads=masters, state=[], backend=backend,
                            overwriting=overwriting)
    graph({"x": torch.ones(2)}, first=True)
    assert not graph.overwrites and graph.first_graph is None
    assert graph.no_overwrite == "1 of 2 gradients not written by one micro-batch (the first: #1)"
    assert backend.captures == 1
    assert torch.equal(masters[1].grad, torch.zeros(2))  # the check's NaN undone
    torch.testing.assert_close(masters[0].grad, torch.tensor([1.0, 2.0, 3.0]))


def _layer(**kw):
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2, **kw)
    return SimpleNamespace(cfg=cfg, check_finite=False)


def test_release_frees_the_graph_and_a_later_call_captures_again():
    """release() hands the captured graph to the backend (once: a second release has nothing to
    free) and drops the static buffers; the next call warms up and captures again, and its
    replays still equal plain steps on a copy of the model in the same state."""
    m, ref = _model(), _model()
    backend = _Counter()
    graph = MicroBatchGraph(_step(m), grads=list(m.parameters()), state=list(m.buffers()), backend=backend)
    batches = [{"x": torch.randn(4, 6), "t": torch.randn(4, 3)} for _ in range(3)]
    graph(batches[0])
    captured = graph.graph
    graph.release()
    graph.release(wait=False)
    assert backend.released == [(captured, True)]
    assert graph.graph is None and graph.out is None and graph.static is None
    _step(ref)(batches[0])
    m.zero_grad(set_to_none=False), ref.zero_grad(set_to_none=False)
    for b in batches[1:]:
        got, want = graph(b), _step(ref)(b)
        assert torch.equal(got[0], want[0])
    assert (backend.warmups, backend.captures) == (4, 2)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.double(), q.grad.double(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fail_at", [None, 2])
def test_the_trainer_frees_its_graph_before_the_process_group_goes(tmp_path, fail_at):
    """The trainer releases the graph when training ends (waiting for the GPU), and after a
    failed step too (without waiting; the step's error is what is reported), before it destroys
    the process group: a graph that captured NCCL collectives and lived on made
    destroy_process_group hang at exit (pytorch/pytorch#115388; every graphed expert-parallel run
    on 2 and 4 H200 before this). On the CPU the graph's stand-in, on a GPU the real graph;
    ``fail_at``: the run raises the allocator's out-of-memory error at that step."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer import run_trainer

    hooks = ["--cuda-graphs-on-cpu", "--report-teardown"] + (["--oom-at-step", str(fail_at)] if fail_at else [])
    proc = run_trainer(["--config", "tiny-cpu", f"name=rel-{fail_at}", f"logging.runs_dir={tmp_path}",
                        "logging.wandb=false", f"data.cache_dir={tmp_path / 'cache'}", "data.default_corpus_mb=2",
                        "train.train_iters=3", "train.lr_warmup_iters=1", "train.eval_interval=0",
                        "train.save_final=false", "train.cuda_graphs=micro_batch"], hooks=hooks, check=fail_at is None)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("teardown:")]
    wait = fail_at is None
    # where the first micro-batch overwrites the gradients (the GPU's graphs), a second graph was
    # captured for it: released after the first, with no second wait
    graphs = 2 if "the first micro-batch overwrites the gradients" in proc.stdout else 1
    assert lines == ([f"teardown: graph released (wait={wait}, process group alive=True)"]
                     + ["teardown: graph released (wait=False, process group alive=True)"] * (graphs - 1)
                     + ["teardown: process group destroyed"]), proc.stdout[-2000:] + proc.stderr[-2000:]
    if fail_at:
        assert proc.returncode == 1 and "out of memory after step 1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("fail_at", [None, 1])
def test_a_teardown_that_never_returns_ends_the_process_with_its_exit_code(tmp_path, fail_at):
    """destroy_process_group made to hang (as NCCL's did with a live graph): after the deadline
    (2 s here) the trainer says so in one line and exits with the run's own code, 0 after a
    finished run (every step logged) and 1 after a failed one (its error line kept)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer import read_metrics, run_trainer

    hooks = ["--hang-teardown", "2"] + (["--oom-at-step", str(fail_at)] if fail_at else [])
    proc = run_trainer(["--config", "tiny-cpu", f"name=hang-{fail_at}", f"logging.runs_dir={tmp_path}",
                        "logging.wandb=false", f"data.cache_dir={tmp_path / 'cache'}", "data.default_corpus_mb=2",
                        "train.train_iters=2", "train.lr_warmup_iters=1", "train.eval_interval=0",
                        "train.save_final=false"], hooks=hooks, check=False, timeout=240)
    assert proc.returncode == (1 if fail_at else 0), proc.stderr[-2000:]
    assert ("megatron-moe-train: warning: torch.distributed.destroy_process_group() did not return in 2 s; "
            "exiting without it (the run itself has ended)") in proc.stderr, proc.stderr[-2000:]
    if fail_at:
        assert "megatron-moe-train: error: CPU out of memory" in proc.stderr, proc.stderr[-2000:]
    else:
        assert [r["step"] for r in read_metrics(tmp_path / "hang-None")] == [1, 2]


def test_what_a_graph_cannot_hold_is_refused_in_one_line():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    check_supported("none", device=cpu, layers=[_layer(mlp_impl="reference")], ep_size=4)  # eager: anything
    check_supported("micro_batch", device=cuda, layers=[_layer(mlp_impl="triton_grouped")], ep_size=1)
    check_supported("micro_batch", device=cuda, layers=[], ep_size=1)  # dense
    for splits in ("padded", "symmetric"):  # sync-free exchanges: a graph holds them
        layers = [_layer(mlp_impl="triton_grouped", a2a_splits=splits)]
        check_supported("micro_batch", device=cuda, layers=layers, ep_size=4, a2a_splits=splits)
    cases = [
        (dict(device=cpu, layers=[], ep_size=1),
         "train.cuda_graphs=micro_batch needs a CUDA GPU (this run is on the cpu): set train.cuda_graphs=none"),
        (dict(device=cuda, layers=[_layer()], ep_size=2),
         "model.moe.expert_parallel_size=2 with model.moe.a2a_splits=host: the token exchange's sizes are "
         "read by the host in every forward, which a CUDA graph cannot hold; set model.moe.a2a_splits=symmetric "
         "(no host read, the exact bytes; one node) or padded (no host read, 2x the exchange's bytes)"),
        (dict(device=cuda, layers=[_layer(mlp_impl="reference")], ep_size=1),
         "model.moe.mlp_impl=reference synchronises with the host in every forward"),
        (dict(device=cuda, layers=[_layer(mlp_impl="capacity")], ep_size=1),
         "model.moe.mlp_impl=capacity synchronises with the host"),
        (dict(device=cuda, layers=[SimpleNamespace(cfg=_layer().cfg, check_finite=True)], ep_size=1),
         "MEGATRON_MOE_CHECK_FINITE=1 reads the layer input's non-finite count on the host"),
    ]
    for kw, text in cases:
        with pytest.raises(ValueError) as e:
            check_supported("micro_batch", **kw)
        assert text in str(e.value) and "\n" not in str(e.value)
        assert "train.cuda_graphs=none" in str(e.value) or "cuda_graphs=none" in str(e.value)


def test_a_blocking_nccl_wait_is_refused_under_expert_parallel_graphs(monkeypatch):
    """TORCH_NCCL_BLOCKING_WAIT=1 makes the count exchange's wait poll an event recorded in the
    capture: refused in one line with expert parallelism; without it (no collective captured)
    it stays allowed."""
    cuda = torch.device("cuda")
    padded = [_layer(mlp_impl="triton_grouped", a2a_splits="padded")]
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(ValueError) as e:
        check_supported("micro_batch", device=cuda, layers=padded, ep_size=2, a2a_splits="padded")
    assert str(e.value).startswith("TORCH_NCCL_BLOCKING_WAIT=1 with model.moe.expert_parallel_size=2")
    assert "\n" not in str(e.value) and "train.cuda_graphs=none" in str(e.value)
    check_supported("micro_batch", device=cuda, layers=padded, ep_size=1)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    check_supported("micro_batch", device=cuda, layers=padded, ep_size=2, a2a_splits="padded")


def test_auto_graphs_one_process_or_padded_ep_on_a_gpu_where_the_model_allows_else_eager():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    ok = [_layer(mlp_impl="triton_grouped")]
    assert resolve_mode("auto", device=cuda, layers=ok, ep_size=1, world_size=1) == ("micro_batch", "")
    assert resolve_mode("auto", device=cuda, layers=[], ep_size=1, world_size=1) == ("micro_batch", "")  # dense
    assert resolve_mode("auto", device=cpu, layers=ok, ep_size=1, world_size=1, simulated=True)[0] == "micro_batch"
    off = [
        (dict(device=cpu, layers=ok, ep_size=1, world_size=1), "the run is on the cpu"),
        (dict(device=cuda, layers=ok, ep_size=1, world_size=2), "2 processes: eager steps overlap the gradient"),
        (dict(device=cuda, layers=ok, ep_size=2, world_size=2),  # the exchange's sizes read on the host
         "model.moe.a2a_splits=host reads the exchange's split sizes on the host in every MoE layer; "
         "model.moe.a2a_splits=symmetric (each expert-parallel group on one node) or padded"),
        (dict(device=cuda, layers=[_layer(mlp_impl="reference")], ep_size=1, world_size=1),
         "model.moe.mlp_impl=reference synchronises with the host in every forward, which a CUDA graph cannot hold"),
        (dict(device=cuda, layers=[SimpleNamespace(cfg=_layer().cfg, check_finite=True)], ep_size=1, world_size=1),
         "MEGATRON_MOE_CHECK_FINITE=1 reads"),
    ]
    for kw, why in off:
        mode, reason = resolve_mode("auto", **kw)
        assert mode == "none" and reason.startswith(why) and "\n" not in reason, (kw, reason)
        assert "cuda_graphs=none" not in reason  # auto never asks the user to switch it off
    # expert parallelism with the padded exchange (no host read): graphs, as for one process
    padded = [_layer(mlp_impl="triton_grouped", a2a_splits="padded")]
    assert resolve_mode("auto", device=cuda, layers=padded, ep_size=2, world_size=4,
                        a2a_splits="padded") == ("micro_batch", "")
    symmetric = [_layer(mlp_impl="triton_grouped", a2a_splits="symmetric")]
    assert resolve_mode("auto", device=cuda, layers=symmetric, ep_size=4, world_size=4,
                        a2a_splits="symmetric") == ("micro_batch", "")
    mode, why = resolve_mode("auto", device=cuda, layers=[_layer(mlp_impl="reference", a2a_splits="padded")],
                             ep_size=2, world_size=2, a2a_splits="padded")
    assert mode == "none" and why.startswith("model.moe.mlp_impl=reference synchronises"), why
    # data parallelism alone, or expert parallelism with host splits: eager
    assert resolve_mode("auto", device=cuda, layers=padded, ep_size=1, world_size=2, a2a_splits="padded")[0] == "none"
    assert resolve_mode("auto", device=cpu, layers=padded, ep_size=2, world_size=2, a2a_splits="padded")[0] == "none"
    # an explicit mode is itself: micro_batch is then refused by check_supported, not resolved away
    assert resolve_mode("micro_batch", device=cpu, layers=ok, ep_size=2, world_size=4) == ("micro_batch", "")
    assert resolve_mode("none", device=cuda, layers=ok, ep_size=1, world_size=1) == ("none", "")
    check_supported("auto", device=cpu, layers=[_layer(mlp_impl="reference")], ep_size=4)  # auto: never refused


def test_config_values():
    assert load_config("tiny-cpu").train.cuda_graphs == "auto"
    assert load_config("tiny-cpu", ["train.cuda_graphs=none"]).train.cuda_graphs == "none"
    assert load_config("tiny-cpu", ["train.cuda_graphs=micro_batch"]).train.cuda_graphs == "micro_batch"
    assert load_config("tiny-cpu", ["train.cuda_graphs=off"]).train.cuda_graphs == "none"  # YAML: False
    with pytest.raises(ConfigError, match=r"train.cuda_graphs.*expected one of \('auto', 'micro_batch', 'none'\)"):
        load_config("tiny-cpu", ["train.cuda_graphs=layer"])
    with pytest.raises(ConfigError, match=r"train.cuda_graphs"):
        load_config("tiny-cpu", ["train.cuda_graphs=true"])


def test_the_trainer_refuses_graphs_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_moe.training", "--config", "tiny-cpu",
                           "train.cuda_graphs=micro_batch", "train.train_iters=1", "train.lr_warmup_iters=0",
                           f"logging.runs_dir={tmp_path}", "logging.wandb=false",
                           f"data.cache_dir={tmp_path / 'cache'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                               "CUDA_VISIBLE_DEVICES": ""})  # the CPU, also on a GPU machine
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("megatron-moe-train: error: train.cuda_graphs=micro_batch needs a CUDA GPU (this run is on "
            "the cpu): set train.cuda_graphs=none") in proc.stderr
    assert not (tmp_path / "cache").exists()  # refused before the data is prepared


# ----------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("extra, overwrite", [
    ([], False), (["model.moe.score_function=sigmoid", "model.moe.expert_bias=true"], False),
    (["train.grad_accumulation_fusion=false"], False), ([], True),
    (["train.grad_accumulation_fusion=false"], True)])
def test_graphed_steps_equal_eager_steps_on_the_gpu(tmp_path, extra, overwrite, recwarn, monkeypatch):
    """tiny-cpu on the GPU (bf16 params, fp32 masters), 6 steps of 2 micro-batches, eager and
    with train.cuda_graphs=auto (the default; on one GPU: micro_batch): the same losses and
    gradient norms to bf16 rounding (the kernels are the same; the replay runs them without the
    host), and the capture reported, with no warning on the way (autograd warns when the capture
    runs on another stream than the warm-up's; torch when the group's device is guessed).
    ``overwrite`` (the default): two captures sharing a memory pool, the first micro-batch's
    overwriting the gradients; else MEGATRON_MOE_GRAPH_OVERWRITE=0, the gradients zeroed."""
    from megatron_moe.training.train import pretrain

    monkeypatch.setenv("MEGATRON_MOE_GRAPH_OVERWRITE", "1" if overwrite else "0")

    out = {}
    for mode in ("none", "auto"):
        cfg = load_config("tiny-cpu", [f"name=g-{mode}", f"logging.runs_dir={tmp_path}", "logging.wandb=false",
                                       f"data.cache_dir={tmp_path / 'cache'}", "data.default_corpus_mb=2",
                                       "train.train_iters=6", "train.lr_warmup_iters=2", "train.eval_interval=3",
                                       "train.save_final=false", f"train.cuda_graphs={mode}", *extra])
        out[mode] = pretrain(cfg)
    needles = ("AccumulateGrad node's stream", "barrier(): using the device", "Guessing device ID")
    assert not [w for w in recwarn if any(n in str(w.message) for n in needles)], [str(w.message) for w in recwarn]
    eager, graphed = out["none"]["losses"], out["auto"]["losses"]
    assert len(eager) == len(graphed) == 6
    assert graphed == pytest.approx(eager, rel=2e-3), (eager, graphed)
    assert out["auto"]["val_loss"] == pytest.approx(out["none"]["val_loss"], rel=2e-3)
    first = json.loads((tmp_path / "g-auto" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["cuda_graph_capture_s"] > 0 and first["cuda_graph_warmup_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("splits", ["padded", "symmetric"])
def test_graphed_expert_parallel_steps_equal_eager_ones_on_two_gpus(tmp_path, splits):
    """tiny-cpu on 2 GPUs (torchrun, NCCL), EP=2 with an exchange that needs no host read
    (a2a_splits padded: NCCL all-to-alls of whole blocks; symmetric: peer-memory copies of the
    valid rows and their barriers): 6 steps eager and with train.cuda_graphs=micro_batch (the
    graph holds the exchanges), the same losses and gradient norms to bf16 rounding, the capture
    reported (with the bf16 compute copies, each step's first micro-batch overwriting the
    gradients from a second capture: the default), none of the trainer's or torch's stream and
    device warnings on stderr, and the process group destroyed without the teardown's deadline
    (the graph released first). The eager run of 'symmetric' is checked against 'host' (the exact
    NCCL exchange)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer import read_metrics, run_trainer

    rows = {}
    runs = [("none", splits), ("micro_batch", splits)] + ([("none", "host")] if splits == "symmetric" else [])
    for mode, sp in runs:
        proc = run_trainer(["--config", "tiny-cpu", f"name=ep-{mode}-{sp}", f"logging.runs_dir={tmp_path}",
                            "logging.wandb=false", f"data.cache_dir={tmp_path / 'cache'}", "data.default_corpus_mb=2",
                            "train.train_iters=6", "train.lr_warmup_iters=2", "train.eval_interval=0",
                            "train.save_final=false", "model.moe.expert_parallel_size=2",
                            f"model.moe.a2a_splits={sp}", f"train.cuda_graphs={mode}"], nproc=2, timeout=600,
                           OMP_NUM_THREADS="4")
        # "megatron-moe-train" also catches the teardown's deadline line: a graph that captured the
        # all-to-alls and outlived the run made destroy_process_group hang (4 H200, 2026-11-28)
        needles = ("megatron-moe-train", "AccumulateGrad node's stream", "barrier(): using the device",
                   "Guessing device ID")
        assert not any(n in proc.stderr for n in needles), proc.stderr[-3000:]
        if mode == "micro_batch":
            assert "the first micro-batch overwrites the gradients" in proc.stdout, proc.stdout[-3000:]
        rows[mode, sp] = read_metrics(tmp_path / f"ep-{mode}-{sp}")
    assert "cuda_graph_capture_s" in rows["micro_batch", splits][0]
    for key in ("lm_loss", "grad_norm"):
        eager, graphed = [r[key] for r in rows["none", splits]], [r[key] for r in rows["micro_batch", splits]]
        assert len(eager) == len(graphed) == 6 and graphed == pytest.approx(eager, rel=2e-3), (key, eager, graphed)
        if splits == "symmetric":
            exact = [r[key] for r in rows["none", "host"]]
            assert eager == pytest.approx(exact, rel=2e-3), (key, exact, eager)
