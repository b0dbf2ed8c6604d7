"""The symmetric exchange (a2a_splits='symmetric') on its CPU stand-in, 3 gloo processes, against
a plain gather of every rank's inputs: rows [0, n_out[q]) of block q reach rank q's block p, in
order, at three sizes (the buffers grow, then serve a smaller size); the backward returns to each
valid input row the gradient of the output row it became (rows past the counts are undefined both
ways: the dispatcher never reads them). Float64, so every comparison is exact."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import run_gloo_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_exchange_worker.py")


def test_rows_and_gradients_equal_a_plain_gather(tmp_path):
    P = 3
    ranks = run_gloo_ranks(WORKER, [str(tmp_path)], P, tmp_path)
    for step in range(3):
        res = [ranks[r][step] for r in range(P)]
        C = res[0]["C"]
        moved = 0
        for q in range(P):  # receiver
            for p in range(P):  # sender
                n = int(res[p]["n_out"][q])
                assert int(res[q]["n_in"][p]) == n
                got = res[q]["y"][p * C:p * C + n]
                assert torch.equal(got, res[p]["x"][q * C:q * C + n]), (step, p, q)
                # the gradient of sender p's row i of block q is receiver q's dy at row p*C + i
                assert torch.equal(res[p]["dx"][q * C:q * C + n], res[q]["dy"][p * C:p * C + n])
                moved += n
        assert moved > 0
    assert [ranks[0][s]["C"] for s in range(3)] == [4, 9, 3]
