"""benchmarks/triton_bundle.sh refuses to run without a Triton version, before it downloads anything,
and benchmarks/device_env.sh puts a carried bundle first on the path with its backends found in its own
tree (the installed Triton's entry points name an AMD backend the bundle lacks: found on an H100,
2026-12-07); the bundle here a stand-in, a tar of a one-line triton package."""
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_version_prints_the_usage_and_leaves_no_bundle(tmp_path):
    shutil.copytree(REPO / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("results"))
    proc = subprocess.run(["bash", "benchmarks/triton_bundle.sh"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "usage: bash benchmarks/triton_bundle.sh VERSION" in proc.stderr
    assert not (tmp_path / ".tri").exists()


def _device_env_tree(root):
    """A repository root with just what benchmarks/device_env.sh reads."""
    (root / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "device_env.sh", root / "benchmarks")
    (root / "megatron_moe").mkdir()


def test_device_env_puts_the_carried_triton_first_on_the_path(tmp_path):
    _device_env_tree(tmp_path)
    pkg = tmp_path / "pkg" / "triton"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '9.9.test'\n")
    (tmp_path / ".tri").mkdir()
    name = f"triton-9.9.test-{tmp_path.name}"  # its own folder under /tmp
    with tarfile.open(tmp_path / ".tri" / f"{name}.tar.xz", "w:xz") as tar:
        tar.add(pkg, arcname="triton")
    script = ("source benchmarks/device_env.sh && "
              "python3 -c 'import os, triton; "
              "print(triton.__version__, triton.__file__, os.environ.get(\"TRITON_BACKENDS_IN_TREE\"))'")
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["9.9.test", f"/tmp/tri-{name}/triton/__init__.py", "1"], proc.stdout
    finally:
        shutil.rmtree(f"/tmp/tri-{name}", ignore_errors=True)


def test_device_env_without_a_bundle_leaves_the_backend_discovery_alone(tmp_path):
    _device_env_tree(tmp_path)
    script = ("unset TRITON_BACKENDS_IN_TREE; source benchmarks/device_env.sh && "
              "python3 -c 'import os; print(os.environ.get(\"TRITON_BACKENDS_IN_TREE\", \"unset\"))'")
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["unset"], proc.stdout
