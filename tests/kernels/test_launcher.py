"""kernels/launcher.py: the launch through the compiled kernel after a key's first.

    pytest tests/kernels/test_launcher.py           # CPU: the key against Triton's, the launch logic
    pytest tests/kernels/test_launcher.py -m gpu    # GPU: the layer's results with it on and off

The key must be at least as fine as Triton's own specialisation (two arguments it keys alike must
specialise alike, or a later launch would run a kernel compiled for other arguments); checked
against Triton's ``native_specialize_impl`` over ints at every boundary it draws, tensors of
several dtypes and alignments, descriptors, bools, floats and None. The launch logic runs with a
stand-in for the JIT function's compile and the compiled kernel's launcher.
"""
from __future__ import annotations

import itertools
import threading
import types

import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

from megatron_moe.kernels import launcher


def _triton_spec(a):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, a, False, True, True)


def _args():
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, -2**31, -2**31 - 16,
            2**32, 2**63 - 16, 2**63 - 1, -2**63, 2**63, 2**64 - 16, 2**64 - 1]
    base = torch.zeros(4096, dtype=torch.uint8)
    tensors = [base[o:o + 256].view(dt) for o in (0, 2, 8, 16, 32) for dt in (torch.bfloat16, torch.float32)
               if o % torch.empty(0, dtype=dt).element_size() == 0]
    tensors += [torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), torch.zeros(4)[1:]]
    descs = []
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x = torch.zeros(64, 64, dtype=torch.bfloat16)
        descs = [TensorDescriptor.from_tensor(t, b) for t in (x, x.float()) for b in ([16, 32], [32, 16], [16, 16])]
    except ImportError:
        pass
    return ints + tensors + descs + [True, False, 0.0, 1.5, -2.0, None]


def test_arg_key_is_at_least_as_fine_as_triton():
    args = _args()
    keys = [launcher.arg_key([a])[0] for a in args]
    specs = [_triton_spec(a) for a in args]
    for (ka, sa, a), (kb, sb, b) in itertools.combinations(zip(keys, specs, args), 2):
        if ka == kb:
            assert sa == sb, f"keyed alike, specialised apart: {a!r} {sa} / {b!r} {sb}"


def test_arg_key_refuses_what_it_does_not_know():
    with pytest.raises(launcher._Unkeyed):
        launcher.arg_key([object()])


# ---- the launch logic, with stand-ins for Triton's compile and the compiled kernel's launcher ----


def _add_kernel(x_ptr, n, BLOCK):  # a JIT function's signature; never compiled here
    pass


class _Compiled:
    """A compiled kernel: records the launcher's calls."""

    def __init__(self):
        self.function, self.packed_metadata, self.calls = object(), object(), []

    def run(self, *a):
        self.calls.append(a)


@pytest.fixture
def fake(monkeypatch):
    """A JIT function whose Triton launch is recorded (and returns one compiled kernel per key)."""
    monkeypatch.delenv("MEGATRON_MOE_FAST_LAUNCH", raising=False)
    monkeypatch.setattr(launcher, "_mirrors_triton", True)
    monkeypatch.setattr(launcher, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda dev: 1234)))
    launcher.clear()
    fn = JITFunction(_add_kernel)
    state = types.SimpleNamespace(triton=[], compiled={})

    def binder(*args, **kwargs):
        bound = dict(zip(fn.arg_names, args))
        bound.update((k, v) for k, v in kwargs.items() if k in fn.arg_names)
        return bound, None, None

    def run(*args, grid, warmup, **kwargs):
        state.triton.append((grid, args, kwargs))
        try:
            key = (launcher.arg_key(args), tuple(sorted(kwargs.items())))
        except launcher._Unkeyed:
            return _Compiled()
        return state.compiled.setdefault(key, _Compiled())

    monkeypatch.setattr(fn, "run", run)
    monkeypatch.setattr(fn, "device_caches", {0: (None, None, None, None, binder)})
    yield fn, state
    launcher.clear()


def test_first_launch_of_a_key_through_triton_then_the_compiled_kernel(fake):
    fn, state = fake
    x, y = torch.zeros(64), torch.zeros(64)
    k = launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16, num_warps=4))
    assert len(state.triton) == 1 and k.calls == []
    launcher.launch(fn, (8, 2), (y, 48), dict(BLOCK=16, num_warps=4))  # same key: other tensor, other n
    assert len(state.triton) == 1
    (call,) = k.calls
    assert call[:5] == (8, 2, 1, 1234, k.function) and call[5] is k.packed_metadata and call[6] is None
    assert call[9:] == (y, 48, 16)  # the positional arguments, then what Triton bound past them
    assert launcher.stats() == {"fast": 1, "triton": 1}


@pytest.mark.parametrize("change", ["n not a multiple of 16", "n = 1", "misaligned tensor", "dtype", "constexpr",
                                    "compile option"])
def test_a_different_specialisation_goes_through_triton(fake, change):
    fn, state = fake
    x = torch.zeros(64)
    args, kw = (x, 32), dict(BLOCK=16, num_warps=4)
    launcher.launch(fn, (4,), args, kw)
    launcher.launch(fn, (4,), args, kw)
    assert len(state.triton) == 1
    new_args, new_kw = {
        "n not a multiple of 16": ((x, 33), kw),
        "n = 1": ((x, 1), kw),
        "misaligned tensor": ((x[1:], 32), kw),
        "dtype": ((x.double(), 32), kw),
        "constexpr": (args, dict(BLOCK=32, num_warps=4)),
        "compile option": (args, dict(BLOCK=16, num_warps=8)),
    }[change]
    launcher.launch(fn, (4,), new_args, new_kw)
    assert len(state.triton) == 2 and state.triton[-1][1] == new_args


def test_grid_function_gets_the_keywords(fake):
    fn, state = fake
    x = torch.zeros(64)
    k = launcher.launch(fn, lambda meta: (meta["BLOCK"] * 2,), (x, 32), dict(BLOCK=16))
    launcher.launch(fn, lambda meta: (meta["BLOCK"] * 3,), (x, 32), dict(BLOCK=16))
    assert k.calls[0][:3] == (48, 1, 1)


def test_switch_off_launch_hook_or_unknown_argument_go_through_triton(fake, monkeypatch):
    fn, state = fake
    x = torch.zeros(64)
    launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))
    monkeypatch.setenv("MEGATRON_MOE_FAST_LAUNCH", "0")
    launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))
    assert len(state.triton) == 2
    monkeypatch.delenv("MEGATRON_MOE_FAST_LAUNCH")
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a HookChain (Triton 3.6+): a profiler's hook in it
        seen = []
        hook.add(seen.append)
        try:
            launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))
        finally:
            hook.remove(seen.append)
        assert len(state.triton) == 3
    n = len(state.triton)
    launcher.launch(fn, (4,), (x, object()), dict(BLOCK=16))  # no key for it: Triton's launch, nothing kept
    launcher.launch(fn, (4,), (x, object()), dict(BLOCK=16))
    assert len(state.triton) == n + 2
    launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))  # the first key still there
    assert len(state.triton) == n + 2


def test_not_kept_when_the_kernel_was_not_loaded(fake):
    """A compile without a launch (tests/kernels/_compile_sm90.py's stand-in driver) leaves the
    compiled kernel without a function: nothing is kept, every launch goes through Triton."""
    fn, state = fake
    x = torch.zeros(64)
    k = launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))
    k.function = None
    launcher.clear()
    launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))
    launcher.launch(fn, (4,), (x, 32), dict(BLOCK=16))
    assert len(state.triton) == 3 and k.calls == []


def test_an_autotuner_is_launched_as_it_is(fake, monkeypatch):
    calls = []

    class Tuner:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    for _ in range(2):
        launcher.launch(Tuner(), (4,), (torch.zeros(4), 16), dict(BLOCK=16))
    assert len(calls) == 2 and launcher.stats()["fast"] == 0


# ---- GPU: the layer with fast launches on and off ----


@pytest.mark.gpu
@pytest.mark.parametrize("activation,top_k", [("gelu", 1), ("swiglu", 2)])
def test_gpu_layer_step_identical_with_and_without_fast_launches(monkeypatch, activation, top_k):
    """A triton_grouped layer's forward and backward, three times with fast launches on (the later
    two through the compiled kernels) and once off: bit-identical outputs and gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_moe.config import MoEConfig
    from megatron_moe.layer import DroplessMoE

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=top_k, activation=activation,
                    mlp_impl="triton_grouped")
    layer = DroplessMoE(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step():
        xx = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        y = layer(xx)
        torch.autograd.backward([y, layer.aux_loss], [dy, torch.ones_like(layer.aux_loss)])
        return [y.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    monkeypatch.setenv("MEGATRON_MOE_FAST_LAUNCH", "1")
    launcher.clear()
    runs = [step() for _ in range(3)]
    assert launcher.stats()["fast"] > 0
    monkeypatch.setenv("MEGATRON_MOE_FAST_LAUNCH", "0")
    runs.append(step())
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_a_threads_first_cuda_call_may_be_a_launch_with_a_tensor_descriptor():
    """Autograd runs the backward in a thread of its own, where on device 0 torch binds no CUDA
    context; Triton 3.6 fills a host tensor descriptor before its launcher binds one, so such a
    launch as the thread's first CUDA call failed ("invalid device context", the GPU suite of
    2026-12-03). A fresh thread whose first call is the Gluon weight gradient computes what the
    main thread's call did."""
    from megatron_moe.kernels import gluon_wgrad as GW
    from megatron_moe.kernels import grouped as G

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GW.available()):
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    gen = torch.Generator().manual_seed(0)
    counts = [100, 0, 156]
    offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(256, 128, generator=gen).to(torch.bfloat16).cuda()
    b = torch.randn(256, 256, generator=gen).to(torch.bfloat16).cuda()
    rows = torch.randperm(256, generator=gen).to(torch.int32).cuda()
    assert GW.supported(a, b, offsets, gather_b_S=rows)
    want = G.grouped_wgrad(a, b, offsets, gather_b_S=rows)  # compiled here
    G.grouped_wgrad(a, b, offsets, gather_b_S=rows)  # its output's memory back in the cache: no cudaMalloc
    torch.cuda.synchronize()
    got, errors = [], []

    def run():
        try:
            got.append(G.grouped_wgrad(a, b, offsets, gather_b_S=rows))  # no CUDA call before it here
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001 (reported in the main thread)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, f"{type(errors[0]).__name__}: {errors[0]}"
    assert torch.equal(got[0], want)


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_fast_launches_sets_the_switch_for_the_block_and_restores_it(monkeypatch, before):
    import os

    from megatron_moe.kernels import switches

    if before is None:
        monkeypatch.delenv("MEGATRON_MOE_FAST_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_MOE_FAST_LAUNCH", before)
    for on in (True, False):
        with pytest.raises(RuntimeError), launcher.fast_launches(on):
            assert switches.fast_launch() is on
            raise RuntimeError  # restored on the way out of an error too
        assert os.environ.get("MEGATRON_MOE_FAST_LAUNCH") == before
