"""The kernels' A/B switches: environment variables, read here and nowhere else.

| variable                | default                                   | set to                                        |
| ----------------------- | ----------------------------------------- | --------------------------------------------- |
| MEGATRON_MOE_AUTOTUNE   | each kernel tunes its configs per shape   | 0: each kernel runs its first config, untuned |
|                         |                                           | (quick GPU test runs)                         |
| MEGATRON_MOE_PERSISTENT | the row-grouped GEMM also tunes its       | 0: one program per tile only                  |
|                         | persistent configs                        |                                               |
| MEGATRON_MOE_TMA_ADD    | an accumulating fp32 weight gradient      | 0: the load-add-store only;                   |
|                         | tunes TMA's reduce-add (sm_90+) against   | 1: the reduce-add only, where a tensor        |
|                         | the kernel's own load-add-store           | descriptor of the output can be made          |
| MEGATRON_MOE_W_TMA      | transposed 16-bit weights are read        | 0: pointer loads only                         |
|                         | through a tensor descriptor (sm_90+)      |                                               |
| MEGATRON_MOE_TUNING_CACHE | tuned configs kept in                   | a folder: kept there; 0: not kept, not read   |
|                         | ~/.cache/megatron-moe/tuning (tuning.py)  | (every process tunes)                         |
| MEGATRON_MOE_TUNING_SHIPPED | the tables in kernels/tuned/ are read | 0: not read (a fresh machine without them)    |
|                         | after the user's folder                   |                                               |
| MEGATRON_MOE_FUSED_ROUTER | the router after its logits runs as   | 0: the plain-PyTorch router (~40 more torch   |
|                         | kernels/router.py's fused kernels         | ops per layer step)                           |
| MEGATRON_MOE_FUSED_NORM | LayerNorm runs kernels/layer_norm.py's    | 0: torch's LayerNorm                          |
|                         | kernels (the weight gradients reduced in  |                                               |
|                         | the backward's own pass)                  |                                               |
| MEGATRON_MOE_BIAS_GRAD  | a linear layer's bias gradient is summed  | 0: torch's reduction (``dy.sum(0)``)          |
|                         | by kernels/column_sum.py (ops/linear.py)  |                                               |
| MEGATRON_MOE_FUSED_GELU | a dense MLP's GELU backward and its first | 0: torch's GELU backward, then the bias sum   |
|                         | layer's bias gradient in one pass         | (MEGATRON_MOE_BIAS_GRAD's)                    |
|                         | (ops/linear.py's ``linear_gelu``)         |                                               |
| MEGATRON_MOE_COMPILE_WORKERS | a new tuning first compiles its     | N: that many processes; 0 or 1: none (the     |
|                         | candidates in forked processes, one per   | autotuner compiles them one by one)           |
|                         | CPU of this rank, at most 8 (tuning.py)   |                                               |
| MEGATRON_MOE_GLUON_WGRAD | a weight gradient of bf16 operands runs  | 0: the Triton kernel for every weight         |
|                         | kernels/gluon_wgrad.py's kernel on sm_90  | gradient                                      |
|                         | where it applies (``supported``)          |                                               |
| MEGATRON_MOE_GLUON_WGRAD_FP32 | fp32 weight gradients too (written  | 0: the Triton kernel for them (its TMA        |
|                         | or added into the trainer's master        | reduce-add or load-add-store)                 |
|                         | gradients) where MEGATRON_MOE_GLUON_WGRAD |                                               |
|                         | sends bf16 ones                           |                                               |
| MEGATRON_MOE_WGRAD_ADD  | prefetch4: an fp32 weight gradient added  | atomic: no prefetch; prefetch: at the tile's  |
|                         | by kernels/gluon_wgrad.py has its tile's  | start; prefetch8: eight blocks before its end |
|                         | lines prefetched into L2 four 64-row      |                                               |
|                         | blocks before the tile's last MMA         |                                               |
| MEGATRON_MOE_GLUON_GEMM | a bf16 row-grouped GEMM (the up and down  | 0: the Triton kernel for every row-grouped    |
|                         | projections, the input gradient) runs     | GEMM                                          |
|                         | kernels/gluon_gemm.py's                   |                                               |
|                         | kernels on sm_90 where they apply         |                                               |
|                         | (``supported``)                           |                                               |
| MEGATRON_MOE_GLUON_DACT | the activation's backward GEMM (bf16,    | 0: the Triton kernel (its dgelu / dswiglu     |
|                         | sm_90) runs kernels/gluon_dact.py's       | epilogue)                                     |
|                         | ping-pong kernel where it applies         |                                               |
|                         | (``supported``)                           |                                               |
| MEGATRON_MOE_GLUON_DACT_TMA | with sorted rows (no gather), that    | 0: its producer warps' cp.async for a too     |
|                         | kernel loads a's blocks by TMA            |                                               |
| MEGATRON_MOE_SORTED_DY  | auto: a top-1 layer's backward permutes   | 1: always; 0: never (dw2 and the activation   |
|                         | dy into expert order once for dw2 and the | backward gather dy's rows themselves)         |
|                         | activation backward where it has 2,048+   |                                               |
|                         | rows an expert (``SORTED_DY_MIN_ROWS``),  |                                               |
|                         | on sm_90                                  |                                               |
| MEGATRON_MOE_SORTED_X   | auto: a top-1 GELU layer's forward       | 1: always; 0: never (the up projection and    |
|                         | permutes x into expert order once for its | dw1 gather x's rows themselves)               |
|                         | up projection (TMA-fed, kernels/          |                                               |
|                         | gluon_gemm.py) and dw1 where it has       |                                               |
|                         | 2,048+ rows an expert                     |                                               |
|                         | (``SORTED_X_MIN_ROWS``), on sm_90         |                                               |
| MEGATRON_MOE_FAST_LAUNCH | a kernel's launches after its first of  | 0: Triton's own launch every time             |
|                         | a key call the compiled kernel directly   |                                               |
|                         | (kernels/launcher.py)                     |                                               |
| MEGATRON_MOE_ROUTER_GEMM | the router's logits GEMMs (bf16 x) run   | 0: torch's GEMMs over the parts stacked       |
|                         | kernels/router_gemm.py's kernels, the     | (~10 more torch ops per layer step)           |
|                         | fp32 operands split in registers          |                                               |
| MEGATRON_MOE_ROUTER_DX_ADD | the router's dL/dx is added into the   | 0: autograd adds the two (one more pass)      |
|                         | experts' dL/dx of the same input by the   |                                               |
|                         | router's backward kernel (local experts)  |                                               |
| MEGATRON_MOE_PEER_READS | one_launch: the symmetric exchange reads  | per_peer: one launch per peer buffer, one     |
|                         | every peer's buffer in one persistent     | program per row tile (the form measured on    |
|                         | launch (kernels/copy_rows.py)             | 2026-11-28)                                   |

MEGATRON_MOE_AUTOTUNE=0 also makes an accumulating weight gradient take its TMA reduce-add
config where one can run.

Each function reads the environment when it is called. The grouped GEMMs' config lists call
:func:`autotune` and :func:`persistent` once, when kernels/grouped.py is imported (so that a
single config never goes through the autotuner, which in some Triton versions benchmarks even
one); everything else is read at each new tuning key (the autotuners' prune functions: the
block-sparse kernels' MEGATRON_MOE_AUTOTUNE, the weight gradient's MEGATRON_MOE_TMA_ADD) or at
each launch (``tma_add_ok``, ``w_tma_ok``, ``gluon_wgrad``, ``wgrad_add``, ``gluon_gemm``, ``gluon_dact_tma``,
``fused_router``, ``router_gemm``, ``fused_norm``, ``bias_grad_kernel``, ``fused_gelu``,
``fast_launch``) or at each layer step (``router_dx_add``, ``sorted_dy``, ``sorted_x``, ``peer_reads``)
or at each new tuning (``compile_workers``), so a test may set those after import. A choice already tuned for a key
stays until the tuning cache is cleared (``grouped.clear_tuning_cache``). The per-launch reads
go through :func:`getenv`, ``os.environ.get`` without its per-call encoding (a layer step reads
~40 switches; ``os.environ.get`` cost 1.5 µs of host time each on an H200 machine).
"""
from __future__ import annotations

import contextlib
import os

_KEYS: dict = {}  # name -> os.environ's encoded key


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read at each call, at a fifth of its host cost: from
    os.environ's own table of encoded keys and values (kept current by its __setitem__ and
    __delitem__, which ``os.environ[...] =`` and monkeypatch.setenv use), without encoding the key
    at every call; ``os.environ.get`` itself where there is no such table (an os.environ
    replaced by a plain mapping)."""
    env = os.environ
    data = getattr(env, "_data", None)
    if not isinstance(data, dict):
        return env.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = env.encodekey(name)
    value = data.get(key)
    return default if value is None else env.decodevalue(value)


def autotune() -> bool:
    """MEGATRON_MOE_AUTOTUNE != "0": tune each kernel's configs per shape."""
    return getenv("MEGATRON_MOE_AUTOTUNE", "1") != "0"


def tuning_candidates(configs: list) -> list:
    """``configs`` when autotuning, else the first of them alone (MEGATRON_MOE_AUTOTUNE=0)."""
    return configs if autotune() else configs[:1]


def persistent() -> bool:
    """MEGATRON_MOE_PERSISTENT != "0": the row-grouped GEMM may run its persistent configs."""
    return getenv("MEGATRON_MOE_PERSISTENT", "1") != "0"


def tma_add() -> bool | None:
    """MEGATRON_MOE_TMA_ADD: False ("0": never TMA's reduce-add), True ("1": only it, where it can
    run), None (unset or any other value: the autotuner chooses)."""
    return {"0": False, "1": True}.get(getenv("MEGATRON_MOE_TMA_ADD"))


def shipped_tuning() -> bool:
    """MEGATRON_MOE_TUNING_SHIPPED != "0": read the tables shipped in kernels/tuned/ (0: a fresh
    machine without them, as benchmarks/first_step.py measures one)."""
    return getenv("MEGATRON_MOE_TUNING_SHIPPED", "1") != "0"


def tuning_cache() -> str | None:
    """MEGATRON_MOE_TUNING_CACHE: where kernels/tuning.py keeps tuned configs ("0": nowhere;
    unset: its default folder)."""
    return getenv("MEGATRON_MOE_TUNING_CACHE") or None


def fingerprint() -> str:
    """The switches that change what the autotuners may choose, as one string: a tuned config
    kept on disk (kernels/tuning.py) serves only the settings it was tuned under."""
    return f"autotune={autotune()} persistent={persistent()} tma_add={tma_add()} w_tma={w_tma()}"


def w_tma() -> bool:
    """MEGATRON_MOE_W_TMA != "0": transposed weights may be read through a tensor descriptor."""
    return getenv("MEGATRON_MOE_W_TMA", "1") != "0"


def fused_router() -> bool:
    """MEGATRON_MOE_FUSED_ROUTER != "0": the router's scores, top-k and losses in fused kernels."""
    return getenv("MEGATRON_MOE_FUSED_ROUTER", "1") != "0"


def fused_norm() -> bool:
    """MEGATRON_MOE_FUSED_NORM != "0": LayerNorm through kernels/layer_norm.py."""
    return getenv("MEGATRON_MOE_FUSED_NORM", "1") != "0"


def fused_gelu() -> bool:
    """MEGATRON_MOE_FUSED_GELU != "0": a dense MLP's GELU backward and its first layer's bias
    gradient in one pass (megatron_moe/ops/linear.py's ``linear_gelu``)."""
    return getenv("MEGATRON_MOE_FUSED_GELU", "1") != "0"


def bias_grad_kernel() -> bool:
    """MEGATRON_MOE_BIAS_GRAD != "0": a linear layer's bias gradient through kernels/column_sum.py
    (megatron_moe/ops/linear.py)."""
    return getenv("MEGATRON_MOE_BIAS_GRAD", "1") != "0"


def compile_workers() -> int:
    """MEGATRON_MOE_COMPILE_WORKERS: processes that compile a new tuning's candidate configs at once
    (kernels/tuning.py ``precompile``); unset: this rank's share of the CPUs it may run on
    (``LOCAL_WORLD_SIZE`` ranks per node), at most 8; 0 or 1: none."""
    value = getenv("MEGATRON_MOE_COMPILE_WORKERS", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"MEGATRON_MOE_COMPILE_WORKERS={value!r}: expected a whole number of processes "
                             "(0 or 1: compile one by one)") from None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = max(1, int(getenv("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(8, cpus // ranks))


def gluon_wgrad() -> bool:
    """MEGATRON_MOE_GLUON_WGRAD != "0": a weight gradient kernels/gluon_wgrad.py takes runs there."""
    return getenv("MEGATRON_MOE_GLUON_WGRAD", "1") != "0"


def gluon_wgrad_fp32() -> bool:
    """MEGATRON_MOE_GLUON_WGRAD_FP32 != "0": an fp32 weight gradient (new, written or added) runs
    kernels/gluon_wgrad.py's kernel where it takes the call (MEGATRON_MOE_GLUON_WGRAD on too)."""
    return getenv("MEGATRON_MOE_GLUON_WGRAD_FP32", "1") != "0"


WGRAD_ADD_WAYS = ("prefetch4", "atomic", "prefetch", "prefetch8")  # the default first


def wgrad_add() -> str:
    """MEGATRON_MOE_WGRAD_ADD: how kernels/gluon_wgrad.py adds a tile into an fp32 gradient (relaxed
    atomic adds, each way): "prefetch4" (default: the tile's lines prefetched into L2 four 64-row
    blocks before the tile's last MMA), "prefetch8" (eight before), "prefetch" (as its MMAs start),
    "atomic" (no prefetch)."""
    value = getenv("MEGATRON_MOE_WGRAD_ADD", WGRAD_ADD_WAYS[0])
    if value not in WGRAD_ADD_WAYS:
        raise ValueError(f"MEGATRON_MOE_WGRAD_ADD={value!r}: expected one of {', '.join(WGRAD_ADD_WAYS)}")
    return value


def gluon_gemm() -> bool:
    """MEGATRON_MOE_GLUON_GEMM != "0": a row-grouped GEMM kernels/gluon_gemm.py takes runs there."""
    return getenv("MEGATRON_MOE_GLUON_GEMM", "1") != "0"


def gluon_dact() -> bool:
    """MEGATRON_MOE_GLUON_DACT != "0": the activation's backward GEMM runs kernels/gluon_dact.py's
    ping-pong kernel where it takes the call."""
    return getenv("MEGATRON_MOE_GLUON_DACT", "1") != "0"


def gluon_dact_tma() -> bool:
    """MEGATRON_MOE_GLUON_DACT_TMA != "0": with sorted rows (no gather) the ping-pong kernel loads
    a's blocks by TMA, not by its producer warps' cp.async."""
    return getenv("MEGATRON_MOE_GLUON_DACT_TMA", "1") != "0"


FAST_LAUNCH = "MEGATRON_MOE_FAST_LAUNCH"


def fast_launch() -> bool:
    """MEGATRON_MOE_FAST_LAUNCH != "0": launches after a key's first call the compiled kernel
    directly (kernels/launcher.py; ``launcher.fast_launches`` sets it for a block)."""
    return getenv(FAST_LAUNCH, "1") != "0"


def router_gemm() -> bool:
    """MEGATRON_MOE_ROUTER_GEMM != "0": the router's logits and their gradients through
    kernels/router_gemm.py (megatron_moe/ops/router_logits.py)."""
    return getenv("MEGATRON_MOE_ROUTER_GEMM", "1") != "0"


SORTED_DY_MIN_ROWS = 2048
"""MEGATRON_MOE_SORTED_DY unset: dy is permuted once where a top-1 layer has at least this many rows an
expert on average (measured: a gain at 2,048, a loss at 512; docs/performance.md)."""


def sorted_dy(rows: int, experts: int, sm90: bool = True) -> bool:
    """Whether a top-1 layer's backward with ``rows`` sorted rows over ``experts`` experts permutes dy
    into expert order once (megatron_moe/ops/triton_grouped_mlp.py) for its activation backward and
    dw2, which then read sorted rows (the activation backward's by TMA) rather than gathering them.
    MEGATRON_MOE_SORTED_DY "1": always; "0": never; unset or "auto": where rows >=
    SORTED_DY_MIN_ROWS * experts on an sm_90 GPU (``sm90``: where it was measured; its activation
    backward is then the TMA-fed Gluon kernel) (anything else: ValueError). Measured on an H100
    (docs/performance.md, "dy sorted once, timed"): at dmoe-small's micro-batch 128 (2,048 rows an
    expert) the two GEMMs 0.27 ms faster for a 0.14 ms copy, the layer 1.6-5% faster; at
    micro-batch 32 (512 rows an expert) dw2 over sorted rows is slower and the copy does not pay."""
    return _by_rows("MEGATRON_MOE_SORTED_DY", SORTED_DY_MIN_ROWS, rows, experts, sm90)


SORTED_X_MIN_ROWS = 2048
"""MEGATRON_MOE_SORTED_X unset: x is permuted once where a top-1 GELU layer has at least this many rows an
expert on average (docs/performance.md)."""


def sorted_x(rows: int, experts: int, sm90: bool = True) -> bool:
    """Whether a top-1 GELU layer's forward with ``rows`` sorted rows over ``experts`` experts permutes x
    into expert order once (megatron_moe/ops/triton_grouped_mlp.py), so that its up projection reads
    sorted rows by TMA (kernels/gluon_gemm.py's plain kernel with GELU's epilogue) and dw1 reads them
    too, rather than both gathering x's rows. MEGATRON_MOE_SORTED_X "1": always; "0": never; unset or
    "auto": where rows >= SORTED_X_MIN_ROWS * experts on an sm_90 GPU (``sm90``) (anything else:
    ValueError)."""
    return _by_rows("MEGATRON_MOE_SORTED_X", SORTED_X_MIN_ROWS, rows, experts, sm90)


def _by_rows(name: str, min_rows: int, rows: int, experts: int, sm90: bool) -> bool:
    """The switch ``name``: "1" on, "0" off; unset or "auto": on where rows >= min_rows * experts on an
    sm_90 GPU; anything else: ValueError naming the three."""
    value = getenv(name, "auto")
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{name}={value!r}: expected auto (the default), 1 (always) or 0 (never)")
    if value != "auto":
        return value == "1"
    return sm90 and rows >= min_rows * max(experts, 1)


def peer_reads() -> str:
    """MEGATRON_MOE_PEER_READS: how the symmetric exchange (megatron_moe/symmetric.py) reads its peers'
    buffers. "one_launch" (the default): one persistent launch over every peer, each rank starting at
    its own buffer; "per_peer": one launch per peer, one program per row tile (as measured on
    2026-11-28); anything else: ValueError."""
    value = getenv("MEGATRON_MOE_PEER_READS", "one_launch")
    if value not in ("one_launch", "per_peer"):
        raise ValueError(f"MEGATRON_MOE_PEER_READS={value!r}: expected one_launch (the default) or per_peer")
    return value


def router_dx_add() -> bool:
    """MEGATRON_MOE_ROUTER_DX_ADD != "0": where the layer's experts are local, their dL/dx is handed
    to the router logits' backward, which adds its own into it (megatron_moe/ops/router_logits.py)."""
    return getenv("MEGATRON_MOE_ROUTER_DX_ADD", "1") != "0"


@contextlib.contextmanager
def setting(name: str, on: bool):
    """Inside the block, the switch ``name`` (one of the variables above) "1" or "0"; restored after."""
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
