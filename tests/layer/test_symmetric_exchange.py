"""The symmetric dispatcher (a2a_splits='symmetric') on its CPU stand-in, 3 and 8 gloo processes, against
a plain single-process computation over every rank's inputs: each received block holds, in order,
the sender's assignments to this rank's experts (stable by expert), and the local expert ids mark
them and nothing else; combining a stand-in expert (each row times its global expert id + 1)
gives every token sum_k w * (e + 1) * x, and the backward its exact gradients for x and the router
weights. Five steps of different sizes: top_k 1, 2 and num_experts, all assignments to one rank,
a rank that receives none, a forward without backward, and a backward that skips the dispatch's
(the workspace then puts one extra barrier before the next exchange, which would otherwise write
the buffer its peers last read). Float64 (the rows' copies compared exactly; the sums over k
run in fp32)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _exchange_worker import EL  # noqa: E402
from _util import run_gloo_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_exchange_worker.py")


@pytest.mark.parametrize("reads, P", [("one_launch", 3), ("per_peer", 3), ("reference", 3), ("one_launch", 8)])
def test_blocks_outputs_and_gradients_equal_a_plain_computation(tmp_path, monkeypatch, reads, P):
    """``reads``: the peers' buffers read in one launch (the kernel, under Triton's interpreter),
    one launch per peer, or by the plain-PyTorch copies (no interpreter: what a CPU-only install
    runs); 3 ranks, and 8 (the paper's expert parallelism)."""
    if reads == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("MEGATRON_MOE_PEER_READS", reads)
    ranks = run_gloo_ranks(WORKER, [str(tmp_path)], P, tmp_path)
    for step in range(len(ranks[0])):
        res = [ranks[r][step] for r in range(P)]
        for q in range(P):  # receiver: block p holds sender p's assignments to q's experts
            N = res[q]["ids"].numel()
            for p in range(P):
                ids_N = res[p]["ids"].reshape(-1)
                mine = [a for a in torch.argsort(ids_N, stable=True).tolist() if ids_N[a] // EL == q]
                K = res[p]["ids"].shape[1]
                n = len(mine)
                want = res[p]["x"][[a // K for a in mine]]
                assert torch.equal(res[q]["x_R"][p * N:p * N + n], want), (step, p, q)
                assert res[q]["local"][p * N:p * N + n].tolist() == [int(ids_N[a]) - q * EL for a in mine]
                assert (res[q]["local"][p * N + n:(p + 1) * N] == EL).all()  # padding marked
        tol = dict(rtol=2e-6, atol=2e-6)  # the sums over k run in fp32 (kernels/permute.py), even for float64
        for r in res:
            scale_TK = (r["ids"] + 1).double()
            coef_T1 = (r["w"] * scale_TK).sum(1, keepdim=True)
            torch.testing.assert_close(r["y"], coef_T1 * r["x"], **tol)
            if r["mode"] == "train":
                torch.testing.assert_close(r["dx"], coef_T1 * r["dy"], **tol)
            else:
                assert r["dx"] is None
            if r["mode"] != "eval":
                torch.testing.assert_close(r["dw"], scale_TK * (r["dy"] * r["x"]).sum(1, keepdim=True),
                                           **tol)
    # one barrier per exchange: 4 per trained step, 2 for the forward alone, 3 when the dispatch's
    # backward is skipped, and one more before the step after it (its first exchange writes the
    # buffer the skipped one's predecessor wrote)
    assert [ranks[0][s]["barriers"] for s in range(5)] == [4, 8, 10, 13, 18]
    assert all(ranks[r][4]["barriers"] == 18 for r in range(P))
