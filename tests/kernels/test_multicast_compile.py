"""benchmarks/proto_multicast.py's two-CTA kernels compile for Hopper (sm_90) on a machine without a
GPU, and the compiled code does what the performance notes say Triton >= 3.8 does ("TMA multicast
in the Triton of torch 2.12 to 2.14"): w's block loaded once and multicast to both CTAs of the
cluster, and a consumer's release of a ring slot reaching the other CTA (a remote arrive). With an
older Triton the release is a local arrive, and the test says so by skipping."""
from __future__ import annotations

import re

import pytest
from _util import compile_only_output


def _triton_version():
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.mark.slow
def test_the_cluster_kernels_multicast_w_and_release_slots_across_ctas():
    pytest.importorskip("triton.backends.nvidia")
    if _triton_version() < (3, 8):
        pytest.skip("Triton < 3.8: no arrive across the CTAs of a cluster in Gluon (docs/performance.md)")
    out = compile_only_output("proto_multicast.py")
    kernels = re.split(r"^Triton \S+, ", out, flags=re.M)[1:]
    assert [k.split(":")[0] for k in kernels] == ["smoke", "grouped", "swiglu"], out
    for text in kernels:
        assert "'.reqnctapercluster 2'" in text, text
        assert "multicast::cluster" in text, text  # w's block, once for both CTAs
        assert "mbarrier.arrive.shared::cluster" in text, text  # the release reaches the lead CTA
    shared = {m.group(1): int(m.group(2)) for m in re.finditer(r"^Triton \S+, (\w+): .*?, (\d+) bytes of shared", out,
                                                               flags=re.M)}
    assert len(shared) == 3 and max(shared.values()) <= 227 * 1024, f"shared memory a CTA: {shared}"
