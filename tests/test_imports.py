"""The package's layering, checked on the source: imports point down the tiers only.

    kernels (megatron_moe.kernels)  <-  ops  <-  the layer (megatron_moe/*.py)
        <-  megatron (megatron_moe.megatron)  <-  training (megatron_moe.training)  <-  tools

A module may import its own tier and the tiers below it, never above, lazily or not. The layer
and everything under it need torch and triton only (no megatron, wandb, yaml or sentencepiece,
even inside a function); the Megatron integration does not need the training program's
dependencies (wandb, sentencepiece). No module imports another module's private (``_name``)
helpers. And, run in a fresh interpreter: importing ``megatron_moe`` and building and running a
DroplessMoE loads none of those packages.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIERS = ["kernels", "ops", "layer", "megatron", "training", "tools"]
FORBIDDEN = {  # third-party packages a tier must not import
    "kernels": {"megatron", "wandb", "yaml", "sentencepiece"},
    "ops": {"megatron", "wandb", "yaml", "sentencepiece"},
    "layer": {"megatron", "wandb", "yaml", "sentencepiece"},
    "megatron": {"wandb", "sentencepiece"},
    "training": set(),
    "tools": set(),
}


def _module_name(path: Path) -> str:
    """The installed name of a source file (setup.py maps kernels/ and tools/ into the package)."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("kernels", "tools"):
        parts = ["megatron_moe", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _tier(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "megatron_moe":
        return None
    if len(parts) == 1:
        return "layer"
    return {"kernels": "kernels", "ops": "ops", "megatron": "megatron", "training": "training",
            "tools": "tools"}.get(parts[1], "layer")


def _sources() -> list[Path]:
    files = [*REPO.glob("megatron_moe/**/*.py"), *REPO.glob("kernels/*.py"), *REPO.glob("tools/*.py")]
    # the device scripts may link kernels/ and tools/ into the package folder: count them once
    return sorted(p for p in files if p.relative_to(REPO).parts[:2] not in
                  (("megatron_moe", "kernels"), ("megatron_moe", "tools")))


def _imports(path: Path, module: str):
    """(line, imported module, imported names) of every import statement, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [a.name for a in node.names]
            if node.module is None:  # from . import x: x may be a submodule
                for n in names:
                    yield node.lineno, f"{target}.{n}", []
            else:
                yield node.lineno, target, names


def _violations() -> list[str]:
    out = []
    for path in _sources():
        module = _module_name(path)
        tier = _tier(module)
        for line, target, names in _imports(path, module):
            where = f"{path.relative_to(REPO)}:{line}"
            top = target.split(".")[0]
            if top in FORBIDDEN[tier]:
                out.append(f"{where}: the {tier} tier imports {target}")
            target_tier = _tier(target)
            if target_tier is not None and TIERS.index(target_tier) > TIERS.index(tier):
                out.append(f"{where}: {module} ({tier}) imports {target} ({target_tier}), a tier above")
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            if target_tier is not None and private and target != module:
                out.append(f"{where}: {module} imports private {', '.join(private)} from {target}")
    return out


def test_imports_point_down_the_tiers():
    assert _violations() == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The scan is not vacuous: an upward, a forbidden and a private import are each reported."""
    fake = tmp_path / "megatron_moe"
    (fake / "ops").mkdir(parents=True)
    (fake / "ops" / "bad.py").write_text(
        "def f():\n    from megatron_moe.training.precision import BF16Params\n"
        "import yaml\nfrom megatron_moe.kernels.grouped import _rows\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = _violations()
    assert any("a tier above" in v for v in found), found
    assert any("imports yaml" in v for v in found), found
    assert any("private _rows" in v for v in found), found


def test_the_layer_loads_no_training_dependencies():
    code = (
        "import sys, torch\n"
        "from megatron_moe import DroplessMoE, MoEConfig\n"
        "layer = DroplessMoE(MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2))\n"
        "layer(torch.randn(8, 16)).sum().backward()\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'wandb', 'yaml', 'sentencepiece'})\n"
        "print('LOADED', bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout, out.stdout
