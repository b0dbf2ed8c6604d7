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


def test_time_stops_at_once_when_the_compile_stages_cache_is_not_there(root, tmp_path):
    """``time`` on a machine that did not keep ``compile``'s objects would spend its call compiling:
    it stops before unpacking anything, says so, and leaves the cache's state in cache.txt."""
    (root / ".sonic").mkdir()
    (root / ".sonic" / "site.tar.xz").write_bytes(b"")  # present; never unpacked before the stop
    cache = tmp_path / "empty-cache"
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "QUACK_CACHE_DIR": str(cache), "OUT": str(out)}
    proc = subprocess.run(["bash", "benchmarks/sonicmoe.sh", "time", "sonic-1536"], cwd=root, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds no compiled GEMMs" in proc.stdout and "FORCE=1" in proc.stdout
    assert "holds 0 objects" in (out / "cache.txt").read_text()
    assert not (out / "env.txt").exists()  # stopped before the GPU's set-up
