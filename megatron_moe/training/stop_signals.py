"""Ending a run between steps when the job is told to end: SIGTERM or SIGUSR1 save a checkpoint.

    with StopSignals() as stop:             # handlers for SIGTERM and SIGUSR1 (main thread only)
        ...
        name = stop.agreed(device)          # after each step: 'SIGTERM', 'SIGUSR1' or None

Slurm sends SIGTERM at a job's time limit, on preemption and on ``scancel``, then SIGKILL after
its KillWait (30 s by default); torchrun passes a SIGTERM it gets on to its workers and kills them
30 s later. The handler only notes the signal; the training loop asks after each step, saves a
checkpoint and stops, so the run loses no step and ``--resume`` continues it exactly, provided the
step in progress and the save fit in those 30 s (for larger models end each job inside its time
limit with ``train.exit_interval``). SIGUSR1, sent to the trainer processes themselves, does the
same (torchrun does not pass it on). A signal during a checkpoint write waits for the write.

With several processes the answer is agreed on (an all-reduce of the signal number, MAX, one
integer per step), so every rank stops after the same step even when the signal reached only
some of them, or reached them during different steps.
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["StopSignals", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Notes the first of STOP_SIGNALS this process receives while inside the ``with`` block;
    the previous handlers are restored on exit. Outside the main thread (where Python cannot set
    handlers) it notes nothing."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict = {}

    def _note(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def agreed(self, device: torch.device) -> str | None:
        """The signal's name if this process or (under torch.distributed) any rank received one,
        else None. A collective when the world has more than one process: every rank calls it
        after each step."""
        received = self.received or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([received], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        return signal.Signals(received).name if received else None
