"""One writer per run directory: the lock file ``run_dir/.lock``, taken before anything is written there.

    lock = RunLock.acquire(run_dir)    # RunLockError (one line naming the holder) when taken
    try:
        ...                            # config.yaml, metrics.jsonl, wandb/, checkpoints/
    finally:
        lock.release()

The file holds its holder as one JSON line: host, pid, when it was taken, the command, the
process's start time (Linux, ``/proc/PID/stat``: a pid reused by another process is not taken for
the holder), its pid namespace (a container's pids are not this one's, even under the same host
name) and, under Slurm, the job id and restart count. It is created with
``O_CREAT | O_EXCL``, so of two trainers starting at once exactly one gets it (on local
filesystems and NFS alike); the other reads the holder (again a moment later if the winner has not
written it yet) and stops.

A lock whose holder is gone is taken over, with a note: on the same host (and pid namespace) when
its pid is not alive (a killed trainer leaves its lock behind), and in a requeued Slurm job (the same
SLURM_JOB_ID with a higher SLURM_RESTART_COUNT: Slurm ends a job before it requeues it, so
the holder is gone wherever it ran). A lock from another host is never judged: the message says
to delete it by hand if that job is gone. Of several trainers that judge a lock gone at once,
only the one that creates a breaker file named after that holder (``O_EXCL`` again) removes it,
and only if it still is that holder's; then all of them try to create the lock as above, and one
gets it. So a fresh lock is never removed by a trainer that judged its predecessor.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["RunLock", "RunLockError", "LOCK_NAME"]

LOCK_NAME = ".lock"


class RunLockError(RuntimeError):
    """The run directory is locked by another trainer (or holds an unreadable lock)."""


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), None where /proc has none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22; fields 3.. follow the command's ')'


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux): containers on one host may share its name but not
    their pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _me() -> dict:
    """This process as a lock holder."""
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.now().astimezone().isoformat(timespec="seconds"),
          "command": shlex.join(sys.argv), "proc_start": _proc_start(os.getpid()), "pid_ns": _pid_namespace()}
    if os.environ.get("SLURM_JOB_ID"):
        me["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        me["slurm_restart_count"] = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return me


def _gone(holder: dict, me: dict) -> bool:
    """Whether the holder has certainly ended: an earlier run of this requeued Slurm job, or a
    process of this host (and pid namespace) whose pid is not alive (or now belongs to another
    process)."""
    job = holder.get("slurm_job_id")
    same_job = job is not None and job == me.get("slurm_job_id")
    if same_job and holder.get("slurm_restart_count", 0) < me["slurm_restart_count"]:
        return True  # Slurm requeued this job: its earlier run has ended
    if holder["host"] != me["host"] or holder.get("pid_ns") != me["pid_ns"]:
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive
        pass
    recorded, now = holder.get("proc_start"), _proc_start(holder["pid"])
    return recorded is not None and now is not None and recorded != now


def _read(path: Path) -> dict | None:
    """The holder ``path`` names; None when the file vanished meanwhile. An empty file is being
    written by the trainer that just created it: it is read again a moment later."""
    for _ in range(20):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        if text:
            break
        time.sleep(0.05)
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) or not holder.get("host"):
        raise RunLockError(
            f"{path} is not a lock this program can read ({text[:60]!r}; a trainer killed while "
            f"taking it leaves it empty): if no trainer uses {path.parent}, delete {path}")
    return holder


def _create(path: Path, line: str) -> bool:
    """Create ``path`` holding ``line``; False if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")
    return True


def _break(path: Path, holder: dict, me: dict) -> bool:
    """Remove the lock of ``holder`` (judged gone) if it still is that holder's. Of the trainers
    that judged it gone, only the one that creates the breaker file (O_EXCL, named after the
    holder) may remove it, after checking it still is the holder's: a fresh lock, taken
    meanwhile, is never removed. False when another trainer holds the breaker."""
    name = hashlib.sha1(json.dumps(holder, sort_keys=True).encode()).hexdigest()[:12]
    breaker = path.with_name(f"{path.name}.break-{name}")
    if not _create(breaker, json.dumps(me)):
        return False
    try:
        try:
            if json.loads(path.read_text()) == holder:
                path.unlink()
        except (OSError, ValueError):  # gone or replaced meanwhile
            pass
    finally:
        breaker.unlink()
    return True


def _describe(holder: dict) -> str:
    return f"host {holder['host']}, pid {holder['pid']}, since {holder.get('since', '?')}"


def _refusal(path: Path, holder: dict) -> str:
    """The one line for a run directory another trainer holds."""
    run_dir = path.parent
    if holder["host"] != socket.gethostname():
        return (f"run directory {run_dir} is locked by a trainer on another host ({_describe(holder)}): "
                f"wait for it to finish, or give this run another name=...; this host cannot tell whether "
                f"that job is alive, so if it is gone, delete {path} by hand")
    return (f"run directory {run_dir} is in use by another trainer ({_describe(holder)}): wait for it to "
            f"finish (or stop it), or give this run another name=...; if that process is gone, delete {path}")


@dataclass
class RunLock:
    """A held lock: ``path`` holds ``holder``; ``replaced`` is the gone holder it took over."""

    path: Path
    holder: dict
    replaced: dict | None = None

    @classmethod
    def acquire(cls, run_dir: str | Path) -> "RunLock":
        """Take ``run_dir``'s lock (creating the directory), taking over one whose holder is gone;
        RunLockError naming the holder and what to do when another trainer has it."""
        path = Path(run_dir) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        me, replaced = _me(), None
        for _ in range(100):  # each pass ends in the lock, a refusal, or a look at a changed lock
            if _create(path, json.dumps(me)):
                return cls(path, me, replaced)
            holder = _read(path)
            if holder is None:
                continue
            if not _gone(holder, me):
                raise RunLockError(_refusal(path, holder))
            replaced = holder
            if not _break(path, holder, me):
                time.sleep(0.02)  # another trainer is removing it
        raise RunLockError(f"could not lock run directory {path.parent}: its lock belongs to a trainer "
                           "that is gone, and another start is removing it or was killed doing so: if no "
                           f"trainer uses {path.parent}, delete {path} and {path}.break-*")

    def note(self) -> str | None:
        """A line about the gone holder this lock replaced, if any."""
        if self.replaced is None:
            return None
        return f"note: took over {self.path} from a trainer that is gone ({_describe(self.replaced)})"

    def release(self) -> None:
        """Delete the lock if it is still this one's (someone may have deleted it by hand and
        another trainer taken it)."""
        try:
            if json.loads(self.path.read_text()) == self.holder:
                self.path.unlink()
        except (OSError, ValueError):
            pass
