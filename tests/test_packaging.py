"""What a user gets from ``pip install .``: the wheel's contents, configs found by name from any
folder, the console scripts, the old mlp_impl names, and the optional W&B dependency."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("megatron_moe-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_holds_the_package_its_configs_and_its_license(wheel):
    names = set(wheel.namelist())
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert shipped and all(f"megatron_moe/configs/{n}" in names for n in shipped)
    for module in ("megatron_moe/__init__.py", "megatron_moe/kernels/grouped.py", "megatron_moe/ops/master_grad.py",
                   "megatron_moe/megatron/spec.py", "megatron_moe/training/train.py",
                   "megatron_moe/training/data/preparation.py", "megatron_moe/tools/compare_runs.py"):
        assert module in names, module
    assert not any(n.startswith(("tests/", "benchmarks/", "kernels/", "tools/")) for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = wheel.read(meta).decode()
    assert "License: Apache-2.0" in text or "License-Expression: Apache-2.0" in text
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names)
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert sorted(r.split()[1].split(">")[0] for r in core) == ["torch", "triton"], core
    for extra in ("megatron", "train", "wandb", "plots", "test"):
        assert f"Provides-Extra: {extra}" in text
    entry = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for script in ("megatron-moe-train", "megatron-moe-prepare-data", "megatron-moe-compare-runs",
                   "megatron-moe-find-micro-batch", "megatron-moe-megatron-lm-args", "megatron-moe-rank-timelines"):
        assert f"{script} = " in entry


def test_shipped_config_found_by_name_from_another_folder(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_moe.training", "--config", "dmoe-xs", "--print-config",
                          "train.lr=1e-4"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name: dmoe-xs" in out.stdout and "num_experts: 64" in out.stdout and "lr: 0.0001" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_moe.training", "--config", "dmoe-xz"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no shipped config of that name" in bad.stderr and "dmoe-xs" in bad.stderr


def test_base_resolves_by_shipped_name(tmp_path):
    from megatron_moe.training.run_config import load_config

    mine = tmp_path / "my-run.yaml"
    mine.write_text("base: dmoe-xs\ntrain:\n  lr: 1.0e-4\n")
    cfg = load_config(mine)
    assert cfg.name == "my-run" and cfg.model.moe.num_experts == 64 and cfg.train.lr == 1e-4
    (tmp_path / "dmoe-xs.yaml").write_text("base: gpt-xs\nmodel:\n  moe:\n    num_experts: 4\n")
    assert load_config(mine).model.moe.num_experts == 4  # a file beside it comes first


@pytest.mark.parametrize("old,new", [("grouped", "triton_grouped"), ("grouped_mm", "torch_grouped_mm")])
def test_old_mlp_impl_names_still_work_with_one_notice(old, new, tmp_path):
    from megatron_moe import MoEConfig
    from megatron_moe.megatron.model_config import ModelConfig

    with pytest.warns(FutureWarning, match=rf"MoEConfig\.mlp_impl='{old}' is deprecated: use '{new}'"):
        assert MoEConfig(hidden_size=8, ffn_hidden_size=16, mlp_impl=old).mlp_impl == new
    with pytest.warns(FutureWarning, match=rf"model\.moe\.mlp_impl='{old}' is deprecated"):
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                          moe={"num_experts": 4, "mlp_impl": old})
    assert cfg.moe.mlp_impl == new and cfg.moe_config(1).mlp_impl == new
    out = subprocess.run([sys.executable, "-m", "megatron_moe.training", "--config", "tiny-cpu", "--print-config",
                          f"model.moe.mlp_impl={old}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"mlp_impl: {new}" in out.stdout, out.stderr[-2000:]
    notices = [line for line in out.stderr.splitlines() if "deprecated" in line]
    assert notices == [f"megatron-moe-train: FutureWarning: model.moe.mlp_impl='{old}' is deprecated: use "
                       f"'{new}' (the same code)"], out.stderr


def test_wandb_missing_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from megatron_moe.training.metrics import MetricsLogger
    from megatron_moe.training.run_config import load_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config("tiny-cpu", [f"logging.runs_dir={tmp_path}", "logging.wandb=true"])
    log = MetricsLogger(cfg, cfg.run_dir, enabled=True)
    log.log({"lm_loss": 1.0}, step=1)
    log.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "pip install wandb" in err[0] and "logging.wandb=false" in err[0], err
    assert (cfg.run_dir / "metrics.jsonl").read_text().count("\n") == 1


def test_a_missing_extra_is_named_with_its_install_line(monkeypatch):
    import importlib.util

    from megatron_moe.megatron import require

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("megatron", "yaml")
                        else real(name, *a))
    with pytest.raises(ImportError, match=r"megatron-core, pyyaml not installed: pip install "
                                          r"\"megatron-moe\[train\]\" \(or pip install megatron-core pyyaml\)"):
        require("megatron", "yaml", "numpy", extra="train")
    require("numpy", "torch")  # present: nothing raised
