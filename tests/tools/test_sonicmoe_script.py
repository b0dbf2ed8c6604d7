"""benchmarks/sonicmoe.sh's refusals, which run before anything needs a GPU or SonicMoE: an unknown
stage, and a GPU stage without the carried wheels (it says how to build them)."""
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "sonicmoe.sh"


@pytest.fixture
def root(tmp_path):
    """A folder laid out as the repository root, holding only the script (no .sonic/)."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "sonicmoe.sh")
    return tmp_path


def run(root, *args):
    return subprocess.run(["bash", "benchmarks/sonicmoe.sh", *args], cwd=root, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("stage", ["foo", "times"])
def test_an_unknown_stage_is_refused_with_the_stages_named(root, stage):
    proc = run(root, stage)
    assert proc.returncode == 1
    assert f"unknown stage '{stage}'" in proc.stdout and "bundle, compile or time" in proc.stdout


@pytest.mark.parametrize("stage", ["compile", "time"])
def test_a_gpu_stage_without_the_bundle_says_how_to_build_it(root, stage):
    proc = run(root, stage, "sonic-1536")
    assert proc.returncode == 1
    assert ".sonic/site.tar.xz is missing" in proc.stdout and "sonicmoe.sh bundle" in proc.stdout
    assert not (root / "device_out").exists()  # refused before it wrote anything


def test_no_stage_prints_the_usage(root):
    proc = run(root)
    assert proc.returncode != 0 and "usage: bash benchmarks/sonicmoe.sh bundle|compile|time" in proc.stderr
