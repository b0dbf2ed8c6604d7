"""constraints.txt: every package of setup.py's extras that CI installs is pinned, and the README
section its header points to exists."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.lower()] = version
    return out


def _extras() -> dict[str, list[str]]:
    """setup.py's extras_require, read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    consts = {}
    for n in tree.body:  # MEGATRON = [...]; TRAIN = MEGATRON + [...]
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            value = _literal(n.value, consts)
            if isinstance(value, list):
                consts[n.targets[0].id] = value
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    return {ast.literal_eval(k): _literal(v, consts) for k, v in zip(extras.keys, extras.values)}


def _literal(node, consts):
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.BinOp):
        a, b = _literal(node.left, consts), _literal(node.right, consts)
        return a + b if a is not None and b is not None else None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def test_ci_extras_are_pinned():
    pins = _pins()
    extras = _extras()
    for extra in ("test", "train"):
        for req in extras[extra]:
            name = re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower()
            assert name in pins, f"{name} (extra [{extra}]) is not in constraints.txt"
    assert "pytest-timeout" in pins  # benchmarks/device_run.sh passes --timeout


def test_header_points_to_a_readme_section():
    header = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("#")]
    sections = re.findall(r'README[^"]*"([^"]+)"', " ".join(header))
    assert sections, header
    titles = {m.strip() for m in re.findall(r"^#+ (.+)$", (REPO / "README.md").read_text(), re.M)}
    for s in sections:
        assert s in titles, f"constraints.txt points to README section {s!r}; the README has {sorted(titles)}"
