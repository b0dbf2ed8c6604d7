"""benchmarks/first_step.py's trainer command: micro-batch 32, or the config's where that is
smaller (dmoe-small takes 16, the size that fits an 80 GB GPU: 32 ran out of memory on an H100),
and the caller's overrides last, so they win."""
from pathlib import Path

import pytest
from _util import load_script

PATH = Path(__file__).parents[2] / "benchmarks" / "first_step.py"


@pytest.fixture(scope="module")
def first_step():
    return load_script(PATH)


def _settings(cmd):
    """The last value of each key=value argument, as the trainer applies them."""
    return dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))


@pytest.mark.parametrize("config, overrides, micro", [
    ("dmoe-xs", [], "32"),                                   # the config's 64: capped at 32
    ("dmoe-small", [], "16"),                                # the config's 16 is smaller
    ("tiny-cpu", [], "8"),
    ("dmoe-xs", ["train.micro_batch_size=4"], "4"),          # an override below 32
    ("gpt-small", ["train.micro_batch_size=64"], "64"),      # an override above 32 still wins
])
def test_the_micro_batch(first_step, tmp_path, config, overrides, micro):
    cmd = first_step.command(config, overrides, tmp_path / "runs")
    s = _settings(cmd)
    assert s["train.micro_batch_size"] == micro
    assert s["train.global_batch_size"] == "64" and s["train.train_iters"] == "2"
    assert s["logging.runs_dir"] == str(tmp_path / "runs")
    assert cmd[cmd.index("--config") + 1] == config
    assert cmd[len(cmd) - len(overrides):] == overrides  # last: they win
