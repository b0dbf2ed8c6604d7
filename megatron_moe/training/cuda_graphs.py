"""CUDA graphs for the training step (``train.cuda_graphs``).

    megatron-moe-train --config dmoe-xs train.cuda_graphs=micro_batch

``none`` runs every micro-batch eagerly: the host issues each kernel of the forward and the
backward, a few thousand launches per micro-batch at XS sizes.
``micro_batch`` captures the forward, the loss and the backward of one micro-batch into a CUDA
graph once, at the first step, and replays it for every micro-batch after: one launch for all
of them. What stays eager per step: copying each micro-batch into the graph's input buffers,
adding up its statistics, zeroing the gradients, the gradient reduction of data parallelism,
clipping, the optimizer and the expert-bias update.

The capture, at the first step of the process (a fresh start or a resume), costs
``warmup_iters`` eager forward-backward passes on a side stream (they autotune the kernels and
settle lazy allocations; their effects are undone), then one capture on the same stream; the
trainer prints both times (``cuda graphs: ...``) and logs them as ``cuda_graph_warmup_s`` and
``cuda_graph_capture_s``.

Why a replay is the eager micro-batch:
  * inputs: the batch is copied into static buffers (the shape is fixed: micro_batch_size x
    seq_length);
  * parameters are read by address: the optimizer updates them in place, bf16 copies are
    refreshed in place (precision.py), checkpoints load in place;
  * gradients: the backward adds into fp32 gradients (the masters', or the parameters'
    without bf16_params) that exist before the capture; each step zeroes them in place
    (``zero_grad(set_to_none=False)``) instead of freeing them, so the first micro-batch adds
    into zeros (the same sum: 0 + g = g); with bf16 compute copies (unless
    ``MEGATRON_MOE_GRAPH_OVERWRITE=0``), a second capture writes them instead, replayed for each
    step's first micro-batch, and nothing zeroes them (MicroBatchGraph's ``overwriting``);
  * the step's statistics (LM loss, aux and z losses, dropped fractions, tokens per expert) come
    out of the graph as one static vector that the step adds up after each replay;
  * what the warm-up changed is put back before the capture: gradients zeroed, the model's
    buffers (e.g. the routers' token counts for the expert-bias update) and the RNG states
    restored.

What a graph cannot hold, refused at start-up with one line each (:func:`check_supported`):
a host synchronisation inside the forward or the backward, i.e. ``model.moe.mlp_impl``
'reference' or 'capacity', expert parallelism with ``model.moe.a2a_splits=host`` (the exchange's
split sizes are read by the host), ``MEGATRON_MOE_CHECK_FINITE``; a run on the CPU. Data
parallelism works, and expert parallelism with ``a2a_splits=padded`` (fixed-size exchanges, no
host read: the graph holds the NCCL all-to-alls) or ``symmetric`` (the graph holds the peer-memory
copies and their barriers), with the gradient reduction after the backward
instead of overlapped with it (the backward's per-parameter hooks that start bucket reductions
run only at capture). The exchanges' time (``a2a_ms``) is then not measured: events recorded
inside a capture cannot be timed. ``TORCH_NCCL_BLOCKING_WAIT`` is refused then: its wait polls an
event of the capture.

``auto`` (the default, :func:`resolve_mode`) is ``micro_batch`` on a GPU whose model passes
:func:`check_supported`, for a run of one process or one with expert parallelism and
``a2a_splits`` padded or symmetric (there the eager step is host-bound: dmoe-small at EP = 2
kept 0.67 of one GPU's tokens/s per GPU eager, 0.89 graphed, with padded on 4 H200). It is
``none`` otherwise: on the CPU, under data parallelism or expert parallelism with host splits
(where the eager step overlaps the gradient reduction with the backward), and for what a graph
cannot hold (the trainer prints which).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

import torch

__all__ = ["MicroBatchGraph", "EagerReplay", "check_supported", "resolve_mode"]

_NO_GRAPH_IMPLS = ("reference", "capacity")  # their forward reads device values on the host
_GRAPH_SPLITS = ("padded", "symmetric")  # expert-parallel exchanges sized on the device


def check_supported(mode: str, *, device: torch.device, layers: list, ep_size: int, a2a_splits: str = "host",
                    simulated: bool = False) -> None:
    """Refuse what a CUDA graph of the micro-batch cannot hold (ValueError, one line naming the
    setting and the fix). ``a2a_splits``: ``model.moe.a2a_splits`` (matters with ``ep_size`` > 1).
    ``simulated``: tests run :class:`EagerReplay` on the CPU."""
    if mode in ("none", "auto"):  # auto: resolve_mode decides, and never refuses
        return
    off = "or train.cuda_graphs=none"
    if device.type != "cuda" and not simulated:
        raise ValueError(f"train.cuda_graphs={mode} needs a CUDA GPU (this run is on the {device.type}): "
                         "set train.cuda_graphs=none")
    if ep_size > 1 and os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").lower() in ("1", "true"):
        raise ValueError(f"TORCH_NCCL_BLOCKING_WAIT={os.environ['TORCH_NCCL_BLOCKING_WAIT']} with "
                         f"model.moe.expert_parallel_size={ep_size}: a blocking wait polls an event the CUDA "
                         f"graph's capture recorded, which breaks it; unset it {off}")
    if ep_size > 1 and a2a_splits not in _GRAPH_SPLITS:
        raise ValueError(f"model.moe.expert_parallel_size={ep_size} with model.moe.a2a_splits={a2a_splits}: the "
                         f"token exchange's sizes are read by the host in every forward, which a CUDA graph "
                         f"cannot hold; set model.moe.a2a_splits=symmetric (no host read, the exact bytes; one "
                         f"node) or padded (no host read, {ep_size}x the exchange's bytes) {off}")
    from megatron_moe.experts import resolve_mlp_impl

    for layer in layers:
        impl = resolve_mlp_impl(layer.cfg, torch.bfloat16, "cuda")
        if impl in _NO_GRAPH_IMPLS:
            raise ValueError(f"model.moe.mlp_impl={impl} synchronises with the host in every forward, which "
                             f"a CUDA graph cannot hold: use triton_grouped, torch_grouped_mm or "
                             f"blocksparse with train.cuda_graphs={mode} ({off})")
        if layer.check_finite:
            raise ValueError(f"MEGATRON_MOE_CHECK_FINITE=1 reads the layer input's non-finite count on the "
                             f"host in every forward, which a CUDA graph cannot hold: unset it {off}")


def resolve_mode(mode: str, *, device: torch.device, layers: list, ep_size: int, world_size: int,
                 a2a_splits: str = "host", simulated: bool = False) -> tuple[str, str]:
    """``train.cuda_graphs`` as the run applies it, and why ``auto`` gave ``none`` ("" otherwise):
    ``auto`` is ``micro_batch`` on a GPU (or ``simulated``) in a run of one process, or of expert
    parallelism with ``a2a_splits`` 'padded' or 'symmetric', that :func:`check_supported` accepts, else ``none``;
    the other modes are themselves."""
    if mode != "auto":
        return mode, ""
    if device.type != "cuda" and not simulated:
        return "none", f"the run is on the {device.type}"
    if ep_size > 1 and a2a_splits not in _GRAPH_SPLITS:
        return "none", (f"model.moe.a2a_splits={a2a_splits} reads the exchange's split sizes on the host in every "
                        "MoE layer; model.moe.a2a_splits=symmetric (each expert-parallel group on one node) or "
                        "padded lets a CUDA graph hold the step")
    if world_size > 1 and ep_size == 1:
        return "none", (f"{world_size} processes: eager steps overlap the gradient reduction with the "
                        "backward")
    try:
        check_supported("micro_batch", device=device, layers=layers, ep_size=ep_size, a2a_splits=a2a_splits,
                        simulated=simulated)
    except ValueError as e:
        return "none", str(e).split(": ")[0]
    return "micro_batch", ""


ENV_GRAPH_OVERWRITE = "MEGATRON_MOE_GRAPH_OVERWRITE"
"""By default (with bf16 compute copies) the trainer's graph overwrites the gradients in a step's
first micro-batch instead of zeroing them and adding (MicroBatchGraph's ``overwriting``); ``0``
keeps the zeroing."""


class _CudaGraphs:
    """The real thing: warm-up on a side stream, capture on the same stream, replay. (Autograd
    keeps the stream each parameter's gradient accumulator first ran on: a capture on another
    stream than the warm-up's makes it warn, at every parameter, that it may synchronise.)"""

    def __init__(self):
        self.stream = None

    def warmup(self, fn: Callable[[], torch.Tensor], n: int) -> None:
        if self.stream is None:  # one side stream for every warm-up and capture
            self.stream = torch.cuda.Stream()
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(n):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # the warm-up's freed blocks go back to the device: the capture allocates its own pool
        torch.cuda.empty_cache()

    def capture(self, fn: Callable[[], torch.Tensor], share=None):
        """``share``: a graph captured before whose memory pool this one uses too (they never
        run at the same time: one stream)."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call of another thread (the data loader's pinning, W&B) during
        # the capture does not invalidate it
        with torch.cuda.graph(graph, pool=None if share is None else share.pool(), stream=self.stream,
                              capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    def replay(self, graph, out: torch.Tensor) -> None:
        graph.replay()

    def release(self, graph, wait: bool) -> None:
        if wait:  # no replay in flight while its memory pool goes back
            torch.cuda.synchronize()
        graph.reset()  # CUDA frees an executable graph still in flight once it has run


class EagerReplay:
    """A stand-in for the CPU tests: 'capture' runs the step once to make its static output,
    'replay' runs it again and copies the result into that output. It exercises everything
    around the graph (static inputs and outputs, the warm-up's undo, in-place gradients); what
    it cannot show is a replay that skips the Python (the GPU tests compare that)."""

    def warmup(self, fn, n: int) -> None:
        for _ in range(n):
            fn()

    def capture(self, fn, share=None):
        return fn, fn()

    def replay(self, graph, out: torch.Tensor) -> None:
        out.copy_(graph())

    def release(self, graph, wait: bool) -> None:
        pass


class MicroBatchGraph:
    """``step(batch) -> stats`` (a forward, loss and backward whose result is a 1-D tensor)
    captured at the first call and replayed at every call after.

    ``grads``: the tensors whose ``.grad`` the backward adds into; they get zero gradients before
    the warm-up if they have none, and the caller zeroes them in place between optimizer steps.
    The first call must come when those gradients are zero (a step's first micro-batch): the
    warm-up's gradients are undone by zeroing. ``state``: tensors the step changes in place
    (restored after the warm-up). The returned tensor is the graph's static output: the next
    call overwrites it.

    ``overwriting``: a context manager factory under which the step writes its gradients rather
    than adding into them (ops/master_grad.py's ``overwriting``, for gradients that reach the
    fp32 masters through a ``MasterGrad``). With it the step is captured twice, sharing one
    memory pool: ``first=True`` replays the capture made under it, so a step's first micro-batch
    overwrites the gradients of the step before and they need no zeroing (``overwrites``). One
    eager pass under it, on gradients set to NaN, must leave every gradient finite (each one
    written, none skipped); otherwise the graph adds into zeroed gradients as without it
    (``overwrites`` False, ``no_overwrite`` says why).
    """

    def __init__(self, step: Callable[[dict], torch.Tensor], *, grads: list[torch.Tensor],
                 state: list[torch.Tensor], warmup_iters: int = 2, backend=None,
                 on_capture: Callable[["MicroBatchGraph"], None] | None = None,
                 overwriting: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.step, self.grads, self.state = step, list(grads), list(state)
        self.warmup_iters = warmup_iters
        self.backend = backend if backend is not None else _CudaGraphs()
        self.on_capture = on_capture
        self.overwriting = overwriting
        self.no_overwrite: str | None = None
        self.static: dict[str, torch.Tensor] | None = None
        self.graph = self.out = self.first_graph = self.first_out = None
        self.warmup_s = self.capture_s = None

    @property
    def overwrites(self) -> bool:
        """Whether a step's first micro-batch (``first=True``) overwrites the gradients: no
        zeroing between steps (before the capture: whether it is meant to)."""
        return self.overwriting is not None

    def __call__(self, batch: dict, first: bool = False) -> torch.Tensor:
        if self.graph is None:
            self._capture(batch)
        else:
            if any(g.grad is not ref for g, ref in zip(self.grads, self._grad_refs)):
                raise RuntimeError("cuda_graphs: a gradient the graph adds into was freed or replaced "
                                   "since the capture: zero gradients in place (zero_grad(set_to_none=False))")
            for k, v in batch.items():
                self.static[k].copy_(v, non_blocking=True)
        if first and self.first_graph is not None:
            self.backend.replay(self.first_graph, self.first_out)
            return self.first_out
        self.backend.replay(self.graph, self.out)
        return self.out

    def release(self, wait: bool = True) -> None:
        """Free the captured graph, its memory pool and static buffers (a later call captures
        again). Call it before the process group is destroyed: NCCL's ``ncclCommDestroy`` waits
        for a live graph that captured the communicator's collectives, so a process whose graph
        holds the expert-parallel all-to-alls would hang at exit (pytorch/pytorch#115388). The
        graph cannot go by itself: the step it replays refers back to the trainer, and that
        cycle is freed by the garbage collector, after the process group. ``wait=False`` (a
        failed step, whose GPU work may never end) skips waiting for the GPU."""
        for graph in (self.first_graph, self.graph):
            if graph is not None:
                self.backend.release(graph, wait)
                wait = False  # one wait covers both
        self.graph = self.out = self.first_graph = self.first_out = self.static = None
        self._grad_refs = []

    @torch.no_grad()
    def _undo(self, saved_state: list[torch.Tensor], rng) -> None:
        torch._foreach_zero_([g.grad for g in self.grads])
        for t, s in zip(self.state, saved_state):
            t.copy_(s)
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1])

    def _capture(self, batch: dict) -> None:
        self.static = {k: v.clone() for k, v in batch.items()}
        for g in self.grads:
            if g.grad is None:
                g.grad = torch.zeros_like(g)
        self._grad_refs = [g.grad for g in self.grads]
        saved_state = [t.clone() for t in self.state]
        rng = (torch.random.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        run = lambda: self.step(self.static)  # noqa: E731

        def run_first():  # (a real capture runs this once; EagerReplay at every replay)
            with self.overwriting():
                return self.step(self.static)

        t0 = time.perf_counter()
        self.backend.warmup(run, self.warmup_iters)
        self._undo(saved_state, rng)
        if self.overwriting is not None:
            with torch.no_grad():
                for g in self.grads:
                    g.grad.fill_(float("nan"))
            self.backend.warmup(run_first, 1)
            finite = torch.stack([torch.isfinite(g.grad).all() for g in self.grads]).tolist() if self.grads else []
            unwritten = [i for i, ok in enumerate(finite) if not ok]
            self._undo(saved_state, rng)
            if unwritten:
                self.no_overwrite = (f"{len(unwritten)} of {len(self.grads)} gradients not written by one "
                                     f"micro-batch (the first: #{unwritten[0]})")
                self.overwriting = None
        t1 = time.perf_counter()
        self.graph, self.out = self.backend.capture(run)
        if self.overwriting is not None:
            self.first_graph, self.first_out = self.backend.capture(run_first, share=self.graph)
        self._undo(saved_state, rng)  # a real capture runs nothing; EagerReplay's did
        self.warmup_s, self.capture_s = t1 - t0, time.perf_counter() - t1
        if self.on_capture is not None:
            self.on_capture(self)
