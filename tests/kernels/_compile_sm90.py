"""Compile every Triton kernel the layer and the trainer launch for Hopper (sm_90), without a GPU.

    python tests/kernels/_compile_sm90.py          # prints the kernels compiled, one line each, then
                                                   # ptxas's serialised-MMA notes and spills per kernel

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compiler: a loop-carried
value whose type changes, a layout the compiler cannot build or a TMA descriptor it refuses shows
only when the kernel is compiled for a GPU. Triton compiles for a named target without a driver,
so this script runs the real launch paths on CPU tensors with every launch turned into a compile
for sm_90 (``JITFunction.run(..., warmup=True)`` under a stand-in driver that names the target):
the layer forward and backward for each expert path, activation, dtype and router variant, the
router GEMMs with bf16 and fp32 weights, the fp32 weight-gradient accumulation (TMA reduce-add
and load-add-store), the expert-parallel permutation, the fused cross-entropy, AdamW and
LayerNorm. Nothing runs: buffers are zero-filled, so index tensors stay in range for the torch
ops between launches. One tile config per kernel (``MEGATRON_MOE_AUTOTUNE=0``). Must run in its
own process: the kernels must be defined as JIT functions, not under ``TRITON_INTERPRET=1``
(tests/kernels/test_compile_hopper.py runs it).
"""
from __future__ import annotations

import collections
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["MEGATRON_MOE_AUTOTUNE"] = "0"
os.environ["MEGATRON_MOE_TUNING_CACHE"] = "0"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTX: dict[str, list[str]] = collections.defaultdict(list)  # kernel -> its distinct PTX (up to 8 variants)
# ptxas's notes that it serialised a kernel's tensor-core MMAs (a wait on every wgmma it issues)
WGMMA_NOTES = ("C7509", "C7510", "C7515", "C7517")


def compile_only() -> collections.Counter:
    """Turn launches into compiles for TARGET; returns the counter of kernels compiled."""
    compiled: collections.Counter = collections.Counter()
    from megatron_moe.kernels.tuning import _CompileOnly  # the stand-in forked compiles use

    driver.set_active(_CompileOnly(0, TARGET))  # for an absent sm_90 GPU
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled[self.fn.__name__] += 1
        ptx = kernel.asm.get("ptx")
        if ptx and len(PTX[self.fn.__name__]) < 8 and ptx not in PTX[self.fn.__name__]:
            PTX[self.fn.__name__].append(ptx)
        for flag in ("W_TMA", "TMA_ADD", "DGELU", "GELU"):  # the tensor-memory-unit variants, the GELU's passes, apart
            if kwargs.get(flag):
                compiled[f"{self.fn.__name__} {flag}"] += 1
        return kernel

    JITFunction.run = compile_launch
    # zero-filled buffers: the torch ops between launches index with what kernels would have written
    torch.empty = lambda *a, **k: torch.zeros(*a, **k)
    torch.empty_like = lambda *a, **k: torch.zeros_like(*a, **k)
    torch.Tensor.new_empty = lambda self, *a, **k: self.new_zeros(*a, **k)

    import megatron_moe  # noqa: F401  (every module that binds use_triton)
    import megatron_moe.kernels.grouped as grouped
    from megatron_moe.kernels import _common

    def always(*tensors):
        return True

    original = _common.use_triton
    for mod in list(sys.modules.values()):  # _common itself too; modules imported later bind `always`
        if getattr(mod, "__name__", "").startswith("megatron_moe") and getattr(mod, "use_triton", None) is original:
            mod.use_triton = always
    grouped.num_sms = lambda device: 132
    from megatron_moe.kernels import gluon_dact, gluon_gemm, gluon_wgrad  # the Gluon kernels: "an sm_90 GPU" too
    for mod in (gluon_dact, gluon_gemm, gluon_wgrad):
        mod.on_sm90 = lambda t: True
        mod.num_sms = lambda device: 132
    # TMA descriptors on the CPU tensors: only the tensor-memory unit's layout rules
    grouped._tma_can_describe = lambda t: grouped.TensorDescriptor is not None and grouped._tma_aligned(t)
    return compiled


def _layer_step(impl, dtype, **kw):
    from megatron_moe import DroplessMoE, MoEConfig

    cfg = dict(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, mlp_impl=impl, block_size=64,
               z_loss_coeff=1e-3)
    cfg.update(kw)
    layer = DroplessMoE(MoEConfig(**cfg)).to(dtype)
    x = torch.randn(100, 64, dtype=dtype, requires_grad=True)
    y = layer(x)
    torch.autograd.backward([y, layer.aux_loss], [torch.ones_like(y), torch.ones_like(layer.aux_loss)])


def scenarios():
    from megatron_moe.kernels.adamw import adamw_step_, hyperparameters
    from megatron_moe.kernels.grouped import grouped_gemm, grouped_gemm_dact, grouped_wgrad
    from megatron_moe.kernels.metadata import routing_metadata
    from megatron_moe.ops.cross_entropy import lm_cross_entropy
    from megatron_moe.ops.permute import permute_tokens, unpermute_tokens

    bf16 = torch.bfloat16
    yield "triton_grouped bf16 gelu top-2", lambda: _layer_step("triton_grouped", bf16)
    yield "triton_grouped fp32 gelu", lambda: _layer_step("triton_grouped", torch.float32)

    def gluon_off():  # the Triton kernels where the Gluon ones take the bf16 calls (its W_TMA path: wᵀ)
        from megatron_moe.kernels.switches import setting
        with setting("MEGATRON_MOE_GLUON_GEMM", False):
            _layer_step("triton_grouped", bf16, activation="swiglu")
    yield "triton_grouped bf16 swiglu, Gluon GEMMs off", gluon_off
    yield "triton_grouped bf16 swiglu, sigmoid router, expert bias, renormalised", lambda: _layer_step(
        "triton_grouped", bf16, activation="swiglu", score_function="sigmoid", expert_bias=True,
        normalize_top_k=True)
    yield "triton_grouped bf16, activation recomputed in dw2", lambda: _layer_step(
        "triton_grouped", bf16, recompute_activation=True)
    yield "triton_grouped bf16, top_k = num_experts = 3", lambda: _layer_step(
        "triton_grouped", bf16, num_experts=3, top_k=3, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    yield "blocksparse bf16 gelu", lambda: _layer_step("blocksparse", bf16)
    yield "blocksparse fp32 swiglu", lambda: _layer_step("blocksparse", torch.float32, activation="swiglu")

    def router_shapes():  # the tile shapes: BLOCK_E 64 to 256, BLOCK_K up to 8
        from megatron_moe.ops.route import route

        for E, K, softmax in ((64, 1, True), (128, 8, False), (256, 4, True), (130, 2, False)):
            logits = torch.randn(300, E, requires_grad=True)
            ids, w, counts, aux, z = route(logits, None, K, softmax=softmax, normalize=not softmax,
                                           aux_coeff=0.01, z_coeff=0.001)
            torch.autograd.backward([w, aux, z], [torch.ones_like(w), torch.ones(()), torch.ones(())])
    yield "router tile shapes", router_shapes

    def router_gemms():  # kernels/router_gemm.py: bf16 and fp32 weights, E past 128, dw's partials
        from megatron_moe.kernels.router_gemm import (logits_backward_triton, logits_dw_triton, logits_dx_triton,
                                                      logits_triton)

        for E, w_dtype in ((64, bf16), (130, torch.float32)):
            x, w, g = torch.randn(3000, 96, dtype=bf16), torch.randn(E, 96, dtype=w_dtype), torch.randn(3000, E)
            logits_triton(x, w), logits_dx_triton(g, w, bf16), logits_dw_triton(g, x, w_dtype)
        for w_dtype in (bf16, torch.float32):  # the fused backward, with and without the add
            x, w, g = torch.randn(3000, 96, dtype=bf16), torch.randn(64, 96, dtype=w_dtype), torch.randn(3000, 64)
            logits_backward_triton(g, x, w), logits_backward_triton(g, x, w, need_dw=False, dx_add_TH=x.clone())
            logits_backward_triton(g, x, w, dx_add_TH=x.clone())
    yield "router GEMMs", router_gemms

    def wgrad_accumulate():
        a, b = torch.randn(256, 64, dtype=bf16), torch.randn(256, 128, dtype=bf16)
        offsets = torch.tensor([0, 100, 100, 256], dtype=torch.int32)
        out = torch.zeros(3, 64, 128)
        for tma in ("0", "1"):
            os.environ["MEGATRON_MOE_TMA_ADD"] = tma
            grouped_wgrad(a, b, offsets, out=out, accumulate=True)
        os.environ.pop("MEGATRON_MOE_TMA_ADD")
    yield "fp32 weight-gradient accumulation (load-add-store, TMA reduce-add)", wgrad_accumulate

    def wgrad_gluon():  # kernels/gluon_wgrad.py: a new bf16 gradient, the gather on either operand
        a, b = torch.randn(256, 128, dtype=bf16), torch.randn(256, 96, dtype=bf16)
        offsets = torch.tensor([0, 100, 100, 256], dtype=torch.int32)
        token = torch.zeros(256, dtype=torch.int32)
        grouped_wgrad(a, b, offsets, gather_a_S=token)
        grouped_wgrad(a, b, offsets, gather_b_S=token)
        out = torch.zeros(3, 128, 96)  # fp32: written, then added (the trainer's master gradients)
        grouped_wgrad(a, b, offsets, gather_a_S=token, out=out)
        grouped_wgrad(a, b, offsets, gather_b_S=token, out=out, accumulate=True)
        from megatron_moe.kernels.switches import WGRAD_ADD_WAYS
        b = torch.randn(256, 256, dtype=bf16)  # full tiles: the L2 prefetch of the added tile
        out = torch.zeros(3, 128, 256)
        for way in WGRAD_ADD_WAYS:
            os.environ["MEGATRON_MOE_WGRAD_ADD"] = way
            grouped_wgrad(a, b, offsets, gather_b_S=token, out=out, accumulate=True)
        os.environ.pop("MEGATRON_MOE_WGRAD_ADD")
    yield ("Gluon weight gradient (gather on a, on b; bf16 new, fp32 written and added, each MEGATRON_MOE_WGRAD_ADD)",
           wgrad_gluon)

    def gemm_gluon():  # kernels/gluon_gemm.py: plain (sorted rows; w, wᵀ, gelu) and swiglu (gathered or sorted rows)
        a, w = torch.randn(256, 128, dtype=bf16), torch.randn(3, 128, 256, dtype=bf16)
        offsets = torch.tensor([0, 100, 100, 256], dtype=torch.int32)
        token, weight = torch.zeros(256, dtype=torch.int32), torch.ones(256)
        grouped_gemm(a, w, offsets)
        grouped_gemm(a, w, offsets, gather_S=token, activation="swiglu", act_scale_S=weight)
        grouped_gemm(a, w, offsets, activation="swiglu")
        grouped_gemm(a, w, offsets, activation="gelu", act_scale_S=weight)  # sorted rows (a top-1 up projection)
        grouped_gemm(a, w, offsets, activation="gelu")
        from megatron_moe.kernels import gluon_gemm
        gluon_gemm.GELU_ACT_PART = 32  # act in parts through buffers of their own
        try:
            grouped_gemm(a, w, offsets, activation="gelu", act_scale_S=weight)
        finally:
            gluon_gemm.GELU_ACT_PART = 0
        grouped_gemm(a, torch.randn(3, 256, 128, dtype=bf16).transpose(1, 2), offsets)  # w's [E, N, K] storage
    yield "Gluon row-grouped GEMM", gemm_gluon

    def dact_gluon():  # kernels/gluon_dact.py (on by default, as the Gluon GEMMs): swiglu, gelu; dy gathered, sorted
        dy, w2 = torch.randn(40, 128, dtype=bf16), torch.randn(3, 256, 128, dtype=bf16)
        offsets = torch.tensor([0, 100, 100, 256], dtype=torch.int32)
        token, weight = torch.zeros(256, dtype=torch.int32), torch.ones(256)
        for activation, width in (("swiglu", 512), ("gelu", 256)):
            pre = torch.randn(256, width, dtype=bf16)
            grouped_gemm_dact(dy, w2.transpose(1, 2), offsets, pre, activation, gather_S=token, scale_S=weight)
            # rows sorted (no gather): a's blocks by TMA
            grouped_gemm_dact(torch.randn(256, 128, dtype=bf16), w2.transpose(1, 2), offsets, pre, activation)
        # gelu's ring of 64-deep steps, where K is an odd multiple of 64 (128 takes 128-deep steps)
        dy, w2 = torch.randn(40, 192, dtype=bf16), torch.randn(3, 256, 192, dtype=bf16)
        grouped_gemm_dact(dy, w2.transpose(1, 2), offsets, torch.randn(256, 256, dtype=bf16), "gelu", gather_S=token,
                          scale_S=weight)
    yield "Gluon activation backward (ping-pong)", dact_gluon

    def permutation():
        ids = torch.randint(0, 8, (50, 2))
        routing = routing_metadata(ids, 8, 128)
        x = torch.randn(50, 64, dtype=bf16, requires_grad=True)
        w = torch.rand(50, 2, requires_grad=True)
        unpermute_tokens(permute_tokens(x, routing), w, routing).sum().backward()
    yield "expert-parallel permutation", permutation

    def row_blocks():  # the symmetric exchange's copies: bf16 and fp32 rows, int64 counts, block
        from megatron_moe.kernels.copy_rows import copy_row_blocks  # starts from the device on either side

        for dtype in (bf16, torch.float32):
            src, dst = torch.randn(3 * 40, 768, dtype=dtype), torch.empty(3 * 40, 768, dtype=dtype)
            copy_row_blocks(src, dst, torch.tensor([40, 0, 7]), 40)
        counts, starts = torch.tensor([7]), torch.tensor([33])
        for persistent in (True, False):  # (the per-peer reads' grid: one program per row tile)
            copy_row_blocks(src, dst, counts, 40, src_starts_B=starts, dst_row0=40, persistent=persistent)
            copy_row_blocks(src, dst, counts, 40, src_row0=40, dst_starts_B=starts, persistent=persistent)
        ptrs = torch.tensor([src.data_ptr()] * 3)  # every peer's buffer in one launch, both directions
        copy_row_blocks(src, dst, torch.tensor([4, 0, 9]), 40, src_starts_B=torch.tensor([1, 2, 3]), src_ptrs_B=ptrs,
                        first_block=1)
        copy_row_blocks(src, dst, torch.tensor([4, 0, 9]), 40, src_row0=40, dst_starts_B=torch.tensor([0, 4, 4]),
                        src_ptrs_B=ptrs, first_block=2)
    yield "symmetric exchange row copies", row_blocks

    def cross_entropy():
        logits = torch.randn(16, 5000, dtype=bf16, requires_grad=True)
        lm_cross_entropy(logits, torch.randint(0, 5000, (16,))).sum().backward()
    yield "fused cross-entropy", cross_entropy

    def adamw():
        params = [torch.randn(300), torch.randn(17, 5)]
        grads = [torch.randn_like(p) for p in params]
        hyper = [hyperparameters(1e-3, 0.1, 0.9, 0.95, 1e-8, 1)] * 2
        for state in (torch.float32, torch.bfloat16):
            adamw_step_(params, grads, [torch.zeros_like(p, dtype=state) for p in params],
                        [torch.zeros_like(p, dtype=state) for p in params], hyper,
                        copies=[p.to(bf16) for p in params], grad_scale=torch.ones(()))
    yield "fused AdamW (fp32 and bf16 moments)", adamw

    def norm():  # megatron_moe/ops/layer_norm.py with its switch on: hidden 512 and 2048, bf16
        from megatron_moe.ops.layer_norm import layer_norm
        os.environ["MEGATRON_MOE_FUSED_NORM"] = "1"
        try:
            for hidden in (512, 2048):
                x = torch.randn(64, 2, hidden, dtype=bf16, requires_grad=True)
                w = torch.ones(hidden, dtype=bf16, requires_grad=True)
                b = torch.zeros(hidden, dtype=bf16, requires_grad=True)
                layer_norm(x, w, b, 1e-5).sum().backward()
        finally:
            del os.environ["MEGATRON_MOE_FUSED_NORM"]
    yield "LayerNorm", norm

    def bias_grad():  # megatron_moe/ops/linear.py: the bias gradient's column sum, bf16 and fp32
        from megatron_moe.ops.linear import linear, linear_gelu
        os.environ["MEGATRON_MOE_BIAS_GRAD"] = "1"
        try:
            for dtype in (bf16, torch.float32):
                x = torch.randn(64, 2, 96, dtype=dtype, requires_grad=True)
                w = torch.randn(300, 96, dtype=dtype, requires_grad=True)
                b = torch.zeros(300, dtype=dtype, requires_grad=True)
                linear(x, w, b).sum().backward()
                linear_gelu(x, w, b).sum().backward()  # the GELU's backward with the sum
        finally:
            del os.environ["MEGATRON_MOE_BIAS_GRAD"]
    yield "linear's bias gradient, alone and after a GELU", bias_grad


def ptxas_report() -> tuple[dict[str, set[str]], dict[str, int]] | None:
    """ptxas (Triton's own) run again with -v over every kernel's PTX: (the notes in WGMMA_NOTES
    per kernel, the most bytes a thread spills per kernel over its variants). A loop whose
    accumulator a branch reads (a tile's epilogue in the loop of its steps) made ptxas wait for
    every MMA before the next (kernels/gluon_wgrad.py, 2026-12-03); the kernel was right and slower,
    so only this note showed it. The router's backward spilled at 128 experts (2026-12-06), where it
    ran 2.3x its floor. None without a ptxas."""
    import subprocess
    import tempfile
    from pathlib import Path

    try:  # the ptxas Triton itself runs for sm_90 (Triton 3.9's PTX needs its CUDA 13 one)
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = Path(get_ptxas(90).path)
    except Exception:  # noqa: BLE001  (a Triton without it: not checked)
        return None
    if not ptxas.exists():
        return None
    notes: dict[str, set[str]] = collections.defaultdict(set)
    spills: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kernel, ptxs in sorted(PTX.items()):
            for i, ptx in enumerate(ptxs):
                src = Path(tmp) / f"{kernel}_{i}.ptx"
                src.write_text(ptx)
                err = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", str(src), "-o", str(src) + ".o"],
                                     capture_output=True, text=True).stderr
                notes[kernel] |= {line.split(": ", 1)[-1].split(" in function")[0] for line in err.splitlines()
                                  if any(code in line for code in WGMMA_NOTES)}
                spilled = [int(n) for n in re.findall(r"(\d+) bytes spill stores", err)]
                spills[kernel] = max([spills.get(kernel, 0)] + spilled)
    return {k: v for k, v in notes.items() if v}, spills


def main() -> int:
    compiled = compile_only()
    failed = 0
    for name, fn in scenarios():
        try:
            fn()
            print(f"ok      {name}")
        except Exception as e:  # noqa: BLE001  (each scenario reports, the others still run)
            failed += 1
            print(f"FAILED  {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    for kernel, n in sorted(compiled.items()):
        print(f"compiled {kernel} x{n}")
    report = ptxas_report()
    notes, spills = report or ({}, {})
    for kernel, found in sorted(notes.items()):
        for note in sorted(found):
            print(f"wgmma-serialised {kernel}: {note}")
    for kernel, spilled in sorted(spills.items()):
        if spilled:
            print(f"spills {kernel}: {spilled} bytes a thread")
    if report is None:
        print("wgmma notes not checked: Triton names no ptxas")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
