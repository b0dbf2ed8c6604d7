"""Our layer inside megatron-core's parallel state, on the CPU: gloo processes with megatron-core's
expert-model-parallel groups against one process (EP = 1) on the same global batch.

    pytest tests/megatron/test_megatron_parallel.py     # about 1.5 minutes on 2 CPU cores

Each rank builds the GPT as Megatron-LM does with ``--num-experts 8 --expert-model-parallel-size
EP`` (tests/megatron/_megatron_ep_worker.py) and runs megatron-core's forward_step / backward_step
and finalize_model_grads; megatron-core's DDP and optimizer need CUDA, so the worker reduces the
gradients over the groups DDP reads, by the marks DDP reads, and counts the gradient norm with
get_grad_norm_fp32 over the groups the optimizer reads. Checked: the layer uses megatron-core's
expert-model-parallel group; its experts are the EP = 1 model's slice from the same seed; the
per-token losses; the reduced gradients (dense: the EP = 1 gradient; experts: its slice); the
gradient norm; the expert biases megatron-core's finalize_model_grads updates; the expert shards
of the distributed-checkpoint state dict (the EP = 1 tensors, whatever the EP size). One case runs
the exchange with no host read (``a2a_splits=symmetric`` through MEGATRON_MOE_OVERRIDES).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _megatron_ep_worker import MICRO_BATCHES  # noqa: E402

from _util import run_gloo_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_megatron_ep_worker.py")
E = 8
TOL = dict(rtol=1e-5, atol=1e-6)


def run_ranks(out_dir, world, ep, impl, freq):
    out_dir.mkdir(parents=True, exist_ok=True)
    return run_gloo_ranks(WORKER, [str(out_dir), str(ep), impl, str(freq)], world, out_dir, timeout=600,
                          local_rank=True)


_references = {}


def reference(tmp_path_factory, impl, freq):
    """One process, EP = 1, all micro-batches of the global batch."""
    if (impl, freq) not in _references:
        _references[impl, freq] = run_ranks(tmp_path_factory.mktemp(f"ref-{impl}"), 1, 1, impl, freq)[0]
    return _references[impl, freq]


def assemble(results):
    """{key: the global tensor} from the expert shards of every rank's sharded state dict (main
    replicas only, each element written once)."""
    out = {}
    for res in results:
        for key, shape, offset, replica, data in res["shards"]:
            if any(replica):
                continue
            full, seen = out.setdefault(key, (torch.full(shape, float("nan")), torch.zeros(shape, dtype=torch.int)))
            where = tuple(slice(o, o + n) for o, n in zip(offset, (1,) * (len(shape) - data.dim()) + data.shape))
            full[where] = data.reshape(full[where].shape)
            seen[where] += 1
    for key, (full, seen) in out.items():
        assert (seen == 1).all(), key
    return {key: full.tolist() for key, (full, _) in out.items()}


def is_expert(name):
    return ".experts.w" in name


@pytest.mark.parametrize("world, ep, impl, freq", [
    (2, 2, "reference", 1),
    (4, 4, "reference", 1),
    (8, 8, "reference", 1),   # the paper's setting: one expert per rank
    (4, 2, "reference", 2),   # MoE in layer 1, dense layer 2 (--moe-layer-freq 2)
    (2, 2, "triton_grouped", 1),
    (4, 4, "triton_grouped+symmetric", 1),  # the exchange with no host read (its CPU stand-in)
])
def test_megatron_expert_parallel_matches_one_process(tmp_path, tmp_path_factory, world, ep, impl, freq):
    ref = reference(tmp_path_factory, impl.partition("+")[0], freq)
    results = run_ranks(tmp_path, world, ep, impl, freq)
    El = E // ep
    assert all(ref["uses_megatron_group"]) and ref["counts_cleared"]
    for rank, res in enumerate(results):
        j = res["ep_rank"]
        # megatron-core's groups: EP = consecutive ranks, EDP = the ranks holding the same experts
        assert res["ep_ranks"] == list(range(rank // ep * ep, rank // ep * ep + ep))
        assert res["edp_ranks"] == list(range(rank % ep, world, ep)) and j == rank % ep
        assert res["uses_megatron_group"] == [True] * (2 // freq), "the layers must use megatron-core's EP group"
        # the marks DDP and the optimizer read: experts allreduce=False, everything else unmarked
        assert {n for n, (allreduce, _) in res["marks"].items() if not allreduce} == \
            {n for n in res["marks"] if is_expert(n)} != set()
        assert all(ours == is_expert(n) for n, (_, ours) in res["marks"].items())
        for name, w in res["init"].items():  # the same seed gives each rank the EP = 1 model's slice
            want = ref["init"][name][j * El:(j + 1) * El] if is_expert(name) else ref["init"][name]
            torch.testing.assert_close(w, want, rtol=0, atol=0, msg=name)
        for i, loss in res["losses"].items():
            torch.testing.assert_close(loss, ref["losses"][i], **TOL)
        for name, g in res["reduced"].items():
            want = ref["reduced"][name][j * El:(j + 1) * El] if is_expert(name) else ref["reduced"][name]
            torch.testing.assert_close(g, want, **TOL, msg=name)
        torch.testing.assert_close(res["expert_bias"], ref["expert_bias"], rtol=0, atol=0)
        assert any(b.abs().sum() > 0 for b in res["expert_bias"]) and res["counts_cleared"]
        assert res["grad_norm_1"] == pytest.approx(ref["grad_norm_1"], rel=1e-5)
    assert sorted(i for r in results for i in r["losses"]) == list(range(MICRO_BATCHES))
    # distributed checkpoints: the experts' main replicas tile the EP = 1 tensors, same keys and shapes
    assert assemble(results) == assemble([ref]) != {}
    # the experts' gradients differ between EP ranks: the reduction did not mix them
    assert not torch.equal(results[0]["reduced"]["decoder.layers.0.mlp.moe.experts.w1"],
                           results[1]["reduced"]["decoder.layers.0.mlp.moe.experts.w1"])
