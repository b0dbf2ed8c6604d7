"""tools/find_micro_batch.py as an installed console script: trials run in the user's working
directory (not the source tree, which is site-packages once installed from a wheel), and the
help names the console script and configs by name."""
import json
import subprocess
import sys
from pathlib import Path

from megatron_moe.tools import find_micro_batch as fmb

REPO = Path(__file__).resolve().parents[2]


def test_trials_run_in_the_callers_working_directory(tmp_path, monkeypatch):
    """A fake trial program records its working directory and writes step 2, as a run that fits."""
    fake = tmp_path / "fake_train.py"
    fake.write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "runs = next(a.split('=', 1)[1] for a in args if a.startswith('logging.runs_dir='))\n"
        "name = next(a.split('=', 1)[1] for a in args if a.startswith('name='))\n"
        "os.makedirs(os.path.join(runs, name), exist_ok=True)\n"
        "open(os.environ['CWD_LOG'], 'w').write(os.getcwd())\n"
        "with open(os.path.join(runs, name, 'metrics.jsonl'), 'w') as f:\n"
        "    f.write(json.dumps({'step': 2, 'peak_mem_gb': 1.0}) + '\\n')\n")
    monkeypatch.setattr(fmb, "trial_command", lambda config, overrides, micro, runs_dir, nproc:
                        [sys.executable, str(fake), f"logging.runs_dir={runs_dir}", f"name=mbs-probe-{micro}"])
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("CWD_LOG", str(tmp_path / "cwd.txt"))
    t = fmb.make_subprocess_runner("tiny-cpu", [], timeout_s=60, scratch_parent=str(tmp_path))(4)
    assert t.outcome == fmb.FITS, t.detail
    assert Path((tmp_path / "cwd.txt").read_text()) == work  # not the repository's folder


def test_help_names_the_console_script_and_configs_by_name():
    assert "megatron-moe-find-micro-batch dmoe-xs" in fmb.__doc__
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "find_micro_batch.py"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert "megatron-moe-find-micro-batch dmoe-xs" in proc.stdout
    assert "config name (e.g. dmoe-xs" in proc.stdout


def test_a_config_name_resolves_to_the_shipped_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # far from the source tree
    path, cfg = fmb._load("tiny-cpu", [])
    assert Path(path).is_absolute() and Path(path).is_file() and cfg.name
    assert json.dumps(path)  # a plain string, written into --json


def test_a_trials_peak_is_what_the_process_held(tmp_path):
    """Under CUDA graphs a graph's pool stays reserved after its tensors are freed: the peak a
    trial records is the reserved one where the run logs it, the allocated one where it does not."""
    rows = [{"step": 1, "peak_mem_gb": 40.0, "peak_reserved_gb": 70.5},
            {"step": 2, "peak_mem_gb": 66.6, "peak_reserved_gb": 81.2}]
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lm_lo')  # a torn last line
    assert fmb._steps_logged(m) == (2, 81.2)
    m.write_text("".join(json.dumps({"step": r["step"], "peak_mem_gb": r["peak_mem_gb"]}) + "\n" for r in rows))
    assert fmb._steps_logged(m) == (2, 66.6)
    assert fmb._steps_logged(tmp_path / "absent.jsonl") == (0, None)
