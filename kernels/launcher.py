"""Kernel launches at the cost of the compiled kernel's own launcher, after the first.

    launch(_my_kernel, (cdiv(N, 128),), (x_N, out_N, N), dict(BLOCK=128))   # _my_kernel[grid](x_N, out_N, N, BLOCK=128)

Triton's JIT launch (``kernel[grid](...)``) binds and specialises every argument, builds its cache
key, checks the kernel's globals and builds launch metadata before the compiled kernel's launcher
runs: 32 µs of host time per grouped-GEMM launch on an H200 machine's host, against 8.8 µs for
the launcher alone (benchmarks/profile_layer.py --launch, 2026-12-02). The eager layer step
launches 13-30 kernels, and at small experts its host time exceeded its GPU time
(docs/performance.md, "Launches through the compiled kernel").

Here the first launch of each key goes through Triton (compiling, or loading from its cache) and
records the compiled kernel and the values Triton bound to the parameters not passed
positionally (constexprs and defaults); later launches with the same key call the compiled
kernel's launcher with the same arguments Triton's would have passed. The key holds, per
positional argument, what Triton specialises on (:func:`arg_key`: a tensor's dtype and 16-byte
alignment; an int's being 1, a multiple of 16 and its 32/64-bit range; a descriptor's dtype,
box and layout), the keyword arguments' exact values (constexprs, compile options) and the
device. So runtime arguments go positionally and constexprs by keyword; a runtime int passed by
keyword is still right, only keyed by its value.

Triton's own launch runs instead: under the interpreter, with ``MEGATRON_MOE_FAST_LAUNCH=0``
(kernels/switches.py), while a launch hook is set (Triton's profiler), for an argument type not
listed in :func:`arg_key`, and in a Triton whose JIT launch is not the one this mirrors (checked
once, from its source: Triton 3.6, 3.7.1, 3.8.0 and 3.9 are).
"""
from __future__ import annotations

import ctypes
import inspect
import threading

import torch
import triton
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from . import switches

__all__ = ["launch", "arg_key", "fast_launches", "stats", "clear"]

MAX_ENTRIES = 4096  # keys kept, all kernels together; past it, new keys launch through Triton
_entries: dict = {}
_stats = {"fast": 0, "triton": 0}
_mirrors_triton: bool | None = None
_thread = threading.local()  # .context: this thread has a current CUDA context (or needs none)


class _Unkeyed(Exception):
    """An argument whose specialisation :func:`arg_key` does not know."""


def _int_key(v: int):
    """Triton's int specialisation: 1 (a constexpr), 16-divisibility, i32 / i64 / u64."""
    width = 0 if -2**31 <= v < 2**31 else 1 if -2**63 <= v < 2**63 else 2
    return (v == 1, v % 16 == 0, width)


def _desc_key(d):
    return (type(d), d.base.dtype, tuple(d.block_shape), getattr(d, "layout", None), getattr(d, "padding", None))


def _spec(a):
    t = type(a)
    if t is int:
        return _int_key(a)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None or t is bool or t is str:
        return a  # bool: its value, finer than Triton's "u1"
    if t is float:
        return float  # "fp32", whatever its value
    if hasattr(a, "block_shape") and hasattr(a, "base"):  # a host tensor descriptor (Triton's or Gluon's)
        return _desc_key(a)
    raise _Unkeyed(t.__name__)


_I1, _I16, _I = _int_key(1), _int_key(16), _int_key(3)  # the keys of int32 ints
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


def arg_key(args) -> tuple:
    """What Triton specialises on, per positional argument (at least as fine as its own key):
    :func:`_spec` of each, with int32 ints and plain tensors inline (the launches' hot path)."""
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is int and -0x80000000 <= a <= 0x7FFFFFFF:
            add(_I1 if a == 1 else _I if a & 15 else _I16)
        elif t is _TENSOR or t is _PARAMETER:
            add((a.dtype, not a.data_ptr() & 15))
        else:
            add(_spec(a))
    return tuple(key)


def _triton_mirrored() -> bool:
    """Whether this Triton's JIT launch binds through ``device_caches[device]``'s binder and calls
    ``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, ...)``,
    which the fast path reproduces."""
    global _mirrors_triton
    if _mirrors_triton is None:
        try:
            src = inspect.getsource(JITFunction.run)
        except (OSError, TypeError):
            src = ""
        _mirrors_triton = ("binder = self.device_caches[device]" in src
                           and "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata"
                           in src)
    return _mirrors_triton


def _hooks():
    """Triton's launch enter / exit hooks (passed on as its launch does), or None while one is set."""
    enter, exit_ = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    for h in (enter, exit_):
        if getattr(h, "calls", h):  # a HookChain with hooks in it, or a hook of an older Triton
            return None
    return enter, exit_


def enabled() -> bool:
    """The switch on and this Triton's launch the one mirrored (under the interpreter the kernels
    are not JIT functions, which :func:`launch` launches as they are)."""
    return switches.fast_launch() and _triton_mirrored()


def _bind_context() -> None:
    """Make the current device's primary CUDA context current in this thread (once per thread).
    Triton 3.6 fills a host tensor descriptor's TMA map (``cuTensorMapEncodeTiled``) before its
    launcher binds a context, so a thread's first CUDA call being such a launch failed with
    "invalid device context": autograd's backward thread on device 0, whose ``set_device`` skips the
    runtime call that would bind it (seen on an H200, 2026-12-03). Triton 3.9 binds it there itself."""
    _thread.context = True
    if not torch.cuda.is_available() or not hasattr(driver.active, "utils"):  # the CPU, a compile-only stand-in
        return
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
        if cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) == 0 \
                and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:
            cuda.cuCtxSetCurrent(ctx)


def launch(fn, grid, args: tuple, kwargs: dict, key=None):
    """``fn[grid](*args, **kwargs)`` for a ``triton.jit`` (or Gluon) function ``fn`` (an autotuner,
    or a kernel under the interpreter, is launched as it is); ``grid`` a tuple or a function of the
    keyword arguments. ``key``: a hashable that, with the device, determines the specialisation
    of ``args`` and every value of ``kwargs`` (the caller's own key, saving :func:`arg_key`'s
    work); None: the key is built here."""
    if not getattr(_thread, "context", False):
        _bind_context()
    if not (enabled() and isinstance(fn, JITFunction)):
        _stats["triton"] += 1
        return fn[grid](*args, **kwargs)
    dev = driver.active.get_current_device()
    try:
        k = (id(fn), dev, key) if key is not None else (id(fn), dev, arg_key(args), tuple(kwargs.items()))
        entry = _entries.get(k)
    except (_Unkeyed, TypeError):  # an argument it cannot key, an unhashable keyword value
        entry = k = None
    hooks = _hooks() if entry is not None else None
    if hooks is None:
        _stats["triton"] += 1
        kernel = fn[grid](*args, **kwargs)
        if k is not None and entry is None:
            _remember(k, fn, kernel, args, kwargs, dev)
        return kernel
    _stats["fast"] += 1
    kernel, tail = entry
    if callable(grid):
        grid = grid(kwargs)
    n = len(grid)
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.active.get_current_stream(dev),
               kernel.function, kernel.packed_metadata, None, hooks[0], hooks[1], *args, *tail)
    return kernel


def _remember(k, fn, kernel, args, kwargs, dev) -> None:
    """Keep the kernel Triton launched and the values it bound past the positional arguments."""
    if hasattr(kernel, "result"):  # a compile in flight (Triton's async mode)
        kernel = kernel.result()
    if kernel is None or getattr(kernel, "function", None) is None or len(_entries) >= MAX_ENTRIES:
        return  # not launched (a compile-only stand-in), or the table is full
    binder = fn.device_caches[dev][4]
    bound = list(binder(*args, **kwargs)[0].values())
    _entries[k] = (kernel, tuple(bound[len(args):]))


def fast_launches(on: bool):
    """Inside the block, fast launches on or off (``MEGATRON_MOE_FAST_LAUNCH``, restored after)."""
    return switches.setting(switches.FAST_LAUNCH, on)


def stats() -> dict:
    """Launches since the last :func:`clear`: {'fast': through the compiled kernel, 'triton': through
    Triton's launch (first of a key, or fast launches off)}."""
    return dict(_stats)


def clear() -> None:
    """Forget every key (the next launch of each goes through Triton again) and zero the counts."""
    _entries.clear()
    _stats.update(fast=0, triton=0)
