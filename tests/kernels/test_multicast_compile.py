"""benchmarks/proto_multicast.py's two-CTA kernels compile for Hopper (sm_90) on a machine without a
GPU, and the compiled code does what the performance notes say Triton >= 3.8 does ("TMA multicast
in the Triton of torch 2.12 to 2.14"): w's block loaded once and multicast to both CTAs of the
cluster, and a consumer's release of a ring slot reaching the other CTA (a remote arrive). With an
older Triton the release is a local arrive, and the test says so by skipping."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _triton_version():
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.mark.slow
def test_the_cluster_kernels_multicast_w_and_release_slots_across_ctas():
    pytest.importorskip("triton.backends.nvidia")
    if _triton_version() < (3, 8):
        pytest.skip("Triton < 3.8: no arrive across the CTAs of a cluster in Gluon (docs/performance.md)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "proto_multicast.py"), "--compile-only"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    kernels = re.split(r"^Triton \S+, ", out, flags=re.M)[1:]
    assert [k.split(":")[0] for k in kernels] == ["smoke", "grouped", "swiglu"], out
    for text in kernels:
        assert "'.reqnctapercluster 2'" in text, text
        assert "multicast::cluster" in text, text  # w's block, once for both CTAs
        assert "mbarrier.arrive.shared::cluster" in text, text  # the release reaches the lead CTA
    shared = {m.group(1): int(m.group(2)) for m in re.finditer(r"^Triton \S+, (\w+): .*?, (\d+) bytes of shared", out,
                                                               flags=re.M)}
    assert len(shared) == 3 and max(shared.values()) <= 227 * 1024, f"shared memory a CTA: {shared}"
