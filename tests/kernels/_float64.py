"""Float64 formulas and loops that the kernel tests check against, written out here, apart from
the package (kernels/activation.py holds the package's own).

Legend: T tokens, K top_k, H hidden, E experts; w1 [E, H, F] (swiglu: [E, H, 2F], gate half
first), w2 [E, F, H].
"""
import math

import torch

_C = math.sqrt(2 / math.pi)


def gelu_and_grad(h):
    """GELU (tanh approximation) of h and its derivative."""
    t = torch.tanh(_C * (h + 0.044715 * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _C * (1 + 3 * 0.044715 * h * h)


def gelu(h):
    return gelu_and_grad(h)[0]


def swiglu_and_grads(gate, up):
    """silu(gate) * up and its derivatives by gate and by up."""
    sig = 1 / (1 + torch.exp(-gate))
    return gate * sig * up, up * (sig + gate * sig * (1 - sig)), gate * sig


def activate(h, activation):
    """gelu(h), or swiglu of h = [gate | up] (halves of the last dimension)."""
    if activation == "gelu":
        return gelu(h)
    gate, up = h.chunk(2, dim=-1)
    return swiglu_and_grads(gate, up)[0]


def loop_mlp(x, w1, w2, ids, weights, activation):
    """y[t] = Σ_k weights[t, k] · act(x[t] @ w1[e]) @ w2[e] with e = ids[t, k], one token and one
    k at a time."""
    T, K = ids.shape
    rows = []
    for t in range(T):
        y = torch.zeros(x.shape[1], dtype=x.dtype)
        for k in range(K):
            e = int(ids[t, k])
            y = y + weights[t, k] * (activate(x[t] @ w1[e], activation) @ w2[e])
        rows.append(y)
    return torch.stack(rows)
