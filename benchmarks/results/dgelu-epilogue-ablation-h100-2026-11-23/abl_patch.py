"""One-off (device only, not committed): ablations of the dgelu epilogue, selected by MEGATRON_MOE_ABL bits:
1 = no row-sum (zeros stored), 2 = no gelu math (act = dact = h), 4 = no dscale store at all."""
p = "kernels/grouped.py"
s = open(p).read()
def rep(old, new, count=1):
    global s
    assert s.count(old) == count, (old, s.count(old))
    s = s.replace(old, new)
rep("    PREFETCH: tl.constexpr,\n):", "    PREFETCH: tl.constexpr, ABL: tl.constexpr,\n):")
rep("    PREFETCH: tl.constexpr,  # backward epilogues: load the pre-activation before the main loop\n",
    "    PREFETCH: tl.constexpr,  # backward epilogues: load the pre-activation before the main loop\n    ABL: tl.constexpr,\n")
rep("FAST_MATH, SLOT, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH)", "FAST_MATH, SLOT, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH, ABL)", 2)
rep("            act, dact = _gelu_and_grad(h.to(tl.float32), FAST_MATH)\n",
    "            if ABL & 2:\n                act = h.to(tl.float32)\n                dact = act\n            else:\n"
    "                act, dact = _gelu_and_grad(h.to(tl.float32), FAST_MATH)\n")
rep("        row_sum = tl.sum(acc * act, axis=1)\n",
    "        if ABL & 1:\n            row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)\n        else:\n"
    "            row_sum = tl.sum(acc * act, axis=1)\n")
rep("BLOCK_E=max(2, triton.next_power_of_2(E)), SLOT=_DACT_SLOT, **_dot_args(a_MK.dtype))",
    "BLOCK_E=max(2, triton.next_power_of_2(E)), SLOT=_DACT_SLOT, ABL=int(os.environ.get('MEGATRON_MOE_ABL', '0')), **_dot_args(a_MK.dtype))")
rep("        tl.store(dscale_ptr + rows_o[:, None] * num_slots + offs_slot[None, :], part,\n"
    "                 mask=mask_s[:, None] & (offs_slot < num_slots)[None, :])\n",
    "        if not (ABL & 4):\n"
    "            tl.store(dscale_ptr + rows_o[:, None] * num_slots + offs_slot[None, :], part,\n"
    "                     mask=mask_s[:, None] & (offs_slot < num_slots)[None, :])\n")
open(p, "w").write(s)
