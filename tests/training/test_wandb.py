"""W&B in megatron-moe-train (metrics.py): a resumed run logs each step once, the console says
where W&B writes (the URL, or the offline folders and their ``wandb sync`` command),
``logging.wandb_mode: auto`` follows the credentials wandb itself would use, and a failed online
init falls back to offline in one line.

    pytest tests/training/test_wandb.py -q            # about 20 s, CPU, no network

Offline runs are real wandb runs, read back from the transaction logs wandb writes
(``run_dir/wandb/offline-run-*/run-ID.wandb``: a LevelDB-style log of protobuf records); online
runs are a fake ``wandb.init``; credentials are set up in a throw-away HOME by ``wandb login
--no-verify`` (which writes the netrc without a network call) and checked in a subprocess, since
wandb caches its settings per process.
"""
from __future__ import annotations

import json
import os
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from megatron_moe.training.metrics import MetricsLogger  # noqa: E402
from megatron_moe.training.run_config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "k" * 40  # a well-formed API key (40 characters); never sent anywhere
WANDB_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL", "NETRC",
             "WANDB_CONFIG_DIR", "WANDB_DIR")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Work in tmp_path (the console shows paths relative to it) with no W&B credentials."""
    monkeypatch.chdir(tmp_path)
    for var in WANDB_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def _cfg(mode: str, name: str = "w"):
    return load_config("tiny-cpu", ["logging.runs_dir=runs", "logging.wandb=true", f"name={name}",
                                    f"logging.wandb_mode={mode}"])


def _records(wandb_file: Path):
    """The protobuf records of a .wandb transaction log: a 7-byte header (":W&B", magic,
    version), then LevelDB log blocks of 32 KiB, each chunk with a 7-byte header (crc32c,
    length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, parts = wandb_file.read_bytes(), 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(parts)
            parts = b""


def _history(folder: Path) -> dict[int, dict]:
    """{step: {key: value}} of the history rows in an offline run folder, in file order;
    a step logged twice fails."""
    rows: dict[int, dict] = {}
    for record in _records(next(folder.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            assert step not in rows, f"step {step} twice in {folder.name}"
            rows[step] = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                          for i in record.history.item}
    return rows


def _train(cfg, steps, resume_step=0, exit_code=0, offset=0.0) -> None:
    """One start of a run as the trainer logs it; then wandb.teardown(), which the end of the
    process runs (wandb writes the last records of the transaction log there)."""
    log = MetricsLogger(cfg, cfg.run_dir, enabled=True, resume_step=resume_step)
    for step in steps:
        log.log({"lm_loss": step + offset}, step)
    log.close(exit_code)
    wandb.teardown()


def _w_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("W&B:")]


# ----------------------------------------------------------------------------- resume


def test_resume_logs_every_step_once_and_prints_the_sync_command(in_tmp, capsys):
    """Steps 1-14 logged, a crash, resume from the checkpoint at 10 and run to 20 (11-14 again,
    with other values): the two offline folders hold 1-20 once, and the printed command names
    both, oldest first, as wandb sync reads them."""
    cfg = _cfg("offline")
    _train(cfg, range(1, 15), exit_code=1)
    first_out = capsys.readouterr().out
    _train(cfg, range(11, 21), resume_step=10, offset=0.5)
    out = capsys.readouterr().out

    run_id = (cfg.run_dir / "wandb_run_id").read_text().strip()
    folders = sorted((cfg.run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f"-{run_id}" in f.name for f in folders), folders  # "-1": same second
    first, second = _history(folders[0]), _history(folders[1])
    assert list(first) + list(second) == list(range(1, 21))
    assert first[12]["lm_loss"] == 12.0 and second[15]["lm_loss"] == 15.5
    jsonl = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == list(range(1, 21)) and jsonl[11]["lm_loss"] == 12.5

    rel = [f"runs/w/wandb/{f.name}" for f in folders]
    assert _w_lines(first_out) == ["W&B: offline (logging.wandb_mode=offline)"] + 2 * [
        f"W&B: offline run in {rel[0]}; upload with: wandb sync {rel[0]}"]  # at the start, at the end
    where = f"W&B: offline run in {rel[1]}; upload with: wandb sync {rel[0]} {rel[1]}"
    assert _w_lines(out) == [
        "W&B: offline (logging.wandb_mode=offline)",
        "W&B: steps 11-14 went to W&B before this resume and are not logged again (metrics.jsonl "
        "has the redone values); W&B goes on at step 15",
        where, where]

    # wandb's own CLI takes the printed command as two runs to upload (a dry run sends nothing)
    argv = shlex.split(where.split("upload with: ")[1])
    dry = subprocess.run([sys.executable, "-m", "wandb", *argv[1:2], "--dry-run", *argv[2:]],
                         capture_output=True, text=True, timeout=120)
    assert "Would sync 2 run(s)" in dry.stdout + dry.stderr, dry
    assert all(f"{r}/run-{run_id}.wandb" in dry.stdout + dry.stderr for r in rel)


def test_a_fresh_start_is_a_new_wandb_run_from_step_one(in_tmp, capsys):
    cfg = _cfg("offline")
    _train(cfg, range(1, 6))
    old_id = (cfg.run_dir / "wandb_run_id").read_text().strip()
    _train(cfg, range(1, 4))  # same run directory, no --resume (no checkpoint)
    new_id = (cfg.run_dir / "wandb_run_id").read_text().strip()
    assert new_id != old_id
    (folder,) = (cfg.run_dir / "wandb").glob(f"offline-run-*-{new_id}")
    assert list(_history(folder)) == [1, 2, 3]


# ----------------------------------------------------------------------------- online (fake)


class FakeRun:
    def __init__(self, url: str, sync_dir: str):
        self.url, self.logged, self.summary, self.finished = url, [], {}, None
        self.settings = type("S", (), {"sync_dir": sync_dir})()

    def log(self, values, step):
        self.logged.append(step)

    def finish(self, exit_code=0):
        self.finished = exit_code


def _fake_init(monkeypatch, runs: list, fail_online: bool = False) -> list[dict]:
    """wandb.init that records its arguments; online it returns a FakeRun (or raises with a
    two-line message), offline it runs the real wandb."""
    calls, real = [], wandb.init

    def init(**kwargs):
        calls.append(kwargs)
        if kwargs["mode"] == "offline":
            return real(**kwargs)
        if fail_online:
            raise RuntimeError("could not reach the server\nsecond line of details")
        runs.append(FakeRun(f"https://wandb.example/e/p/runs/{kwargs['id']}", "/tmp/none"))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", init)
    return calls


def test_online_run_prints_its_url_and_resumes_without_redone_steps(in_tmp, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    runs: list[FakeRun] = []
    calls = _fake_init(monkeypatch, runs)
    cfg = _cfg("auto")
    _train(cfg, range(1, 7))
    _train(cfg, range(5, 10), resume_step=4)
    assert [c["mode"] for c in calls] == ["online", "online"]
    assert calls[0]["id"] == calls[1]["id"] and calls[1]["resume"] == "allow"
    assert calls[0]["settings"].init_timeout <= 15 and calls[0]["settings"].finish_timeout > 0
    assert runs[0].logged == [1, 2, 3, 4, 5, 6] and runs[1].logged == [7, 8, 9]
    assert runs[1].finished == 0
    url = f"W&B: online run https://wandb.example/e/p/runs/{calls[0]['id']}"
    mode = "W&B: online (logging.wandb_mode=auto and W&B credentials from WANDB_API_KEY)"
    assert _w_lines(capsys.readouterr().out) == [
        mode, url, url, mode,
        "W&B: steps 5-6 went to W&B before this resume and are not logged again (metrics.jsonl "
        "has the redone values); W&B goes on at step 7", url, url]


def test_failed_online_init_is_one_line_and_logs_offline(in_tmp, monkeypatch, capsys):
    calls = _fake_init(monkeypatch, [], fail_online=True)
    cfg = _cfg("online")
    _train(cfg, range(1, 4))
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert err == ["megatron-moe-train: warning: W&B online init failed (RuntimeError: could not "
                   "reach the server); logging offline instead"], err
    assert [c["mode"] for c in calls] == ["online", "offline"]
    (folder,) = (cfg.run_dir / "wandb").glob("offline-run-*")
    assert list(_history(folder)) == [1, 2, 3]
    rel = f"runs/w/wandb/{folder.name}"
    assert _w_lines(captured.out) == ["W&B: online (logging.wandb_mode=online)"] + 2 * [
        f"W&B: offline run in {rel}; upload with: wandb sync {rel}"]


# ----------------------------------------------------------------------------- wandb_mode auto


def _login(home: Path, *args: str) -> None:
    """``wandb login --no-verify`` into ``home``: stores the key as a user's login does."""
    subprocess.run([sys.executable, "-m", "wandb", "login", "--no-verify", *args, KEY],
                   env=_clean_env(home), check=True, capture_output=True, timeout=120)


def _clean_env(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in WANDB_ENV}
    return {**env, "HOME": str(home), "WANDB_CONFIG_DIR": str(home / "config"), **extra}


def _mode(home: Path, setting: str = "auto", **env) -> tuple[str, str]:
    code = ("import json; from megatron_moe.training.metrics import wandb_mode; "
            f"print(json.dumps(wandb_mode({setting!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(home, **env), cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def test_auto_goes_online_with_a_stored_login(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    mode, why = _mode(home)
    assert mode == "offline" and "no W&B credentials" in why and "wandb login" in why
    _login(home)
    assert (home / ".netrc").exists()  # where `wandb login` put it
    assert _mode(home) == ("online", "logging.wandb_mode=auto and W&B credentials from the login "
                                     "stored by `wandb login`")
    assert _mode(home, "offline") == ("offline", "logging.wandb_mode=offline")


def test_auto_credentials_sources(tmp_path):
    """The environment, a self-hosted login, an older login (netrc entry for api.wandb.ai), an
    api_key in wandb's settings file; a login for another host than the one configured is none."""
    env_only, other_host, legacy, settings = (tmp_path / n for n in ("e", "o", "l", "s"))
    for home in (env_only, other_host, legacy, settings):
        home.mkdir()
    assert _mode(env_only, WANDB_API_KEY=KEY)[0] == "online"
    _login(other_host, "--host", "https://wandb.example.com")
    assert _mode(other_host)[0] == "online"  # its settings point wandb at that host
    assert _mode(other_host, WANDB_BASE_URL="https://api.wandb.ai")[0] == "offline"
    (legacy / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    (legacy / ".netrc").chmod(0o600)
    assert _mode(legacy)[0] == "online"
    (settings / "config").mkdir()
    (settings / "config" / "settings").write_text(f"[default]\napi_key = {KEY}\n")
    assert _mode(settings)[0] == "online"
