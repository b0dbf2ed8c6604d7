"""How far AdamW's moments drift when stored in bf16 (``train.adam_moments_dtype=bf16``).

    python benchmarks/bf16_moments_drift.py            # CPU, ~1 minute

Each of 100,000 elements gets a random gradient per step (normal, a per-element scale spread
over e^±4, a magnitude that drifts slowly over the run); its moments are tracked twice for
3,000 steps: in fp32, and updated in fp32 but stored rounded to nearest bf16 after each step
(what the fused AdamW kernel does). Printed per beta2: the ratio of the bf16-stored second
moment to the fp32 one (median, 1st and 99th percentiles) and the median relative error of the
update direction m / sqrt(v). A second moment that moves by less than half a bf16 step per
update (relative step 2^-8 to 2^-7) stalls; that sets the limit train.adam_beta2 <= 0.99.
"""
from __future__ import annotations

import argparse

import torch


def drift(beta2: float, beta1: float = 0.9, n: int = 100_000, steps: int = 3000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, generator=gen) * 2) * 1e-3
    v32, m32 = torch.zeros(n), torch.zeros(n)
    v16, m16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for t in range(steps):
        g = torch.randn(n, generator=gen) * scale * (1 + 0.5 * torch.sin(torch.tensor(t / 300.0)))
        v32 = beta2 * v32 + (1 - beta2) * g * g
        m32 = beta1 * m32 + (1 - beta1) * g
        v16 = (beta2 * v16.float() + (1 - beta2) * g * g).to(torch.bfloat16)
        m16 = (beta1 * m16.float() + (1 - beta1) * g).to(torch.bfloat16)
    ratio = v16.float() / v32
    u32, u16 = m32 / v32.sqrt(), m16.float() / v16.float().sqrt()
    err = ((u16 - u32).abs() / u32.abs().clamp_min(1e-6)).median().item()
    return ratio.median().item(), ratio.quantile(0.01).item(), ratio.quantile(0.99).item(), err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--betas", default="0.95,0.98,0.99,0.995,0.999")
    args = ap.parse_args()
    print(f"{'beta2':>6} {'v bf16/fp32 median':>19} {'p1':>7} {'p99':>7} {'update rel. error':>18}")
    for b2 in map(float, args.betas.split(",")):
        med, p1, p99, err = drift(b2)
        print(f"{b2:>6} {med:>19.4f} {p1:>7.4f} {p99:>7.4f} {err:>18.4f}")


if __name__ == "__main__":
    main()
