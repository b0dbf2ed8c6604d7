"""Ending a run between steps when the job is told to end: SIGTERM or SIGUSR1 save a checkpoint.

    with StopSignals() as stop:             # handlers for SIGTERM and SIGUSR1 (main thread only)
        flags_S = stop.flags(device)        # in each step: summed over the ranks with its statistics
        name = stop.first(reduced_flags_S)  # 'SIGTERM', 'SIGUSR1' or None

Slurm sends SIGTERM at a job's time limit, on preemption and on ``scancel``, then SIGKILL after
its KillWait (30 s by default); torchrun passes a SIGTERM it gets on to its workers and kills them
30 s later. The handler only notes the signal; each training step carries it to the loop, which
saves a checkpoint after that step and stops, so the run loses no step and ``--resume`` continues
it exactly, provided the step in progress and the save fit in those 30 s (for larger models end
each job inside its time limit with ``train.exit_interval``). SIGUSR1, sent to the trainer
processes themselves, does the same (torchrun does not pass it on). A signal during a
checkpoint write waits for the write.

With several processes the answer is agreed on: each rank's flags travel in the all-reduce of
the step's statistics (train.py, ``train_step``: no collective or host synchronisation of their
own), so every rank stops after the same step even when the signal reached only some of them,
or reached them during different steps.
"""
from __future__ import annotations

import signal
import threading

import torch

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
        self._flags, self._flags_key = None, None

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

    def flags(self, device: torch.device) -> torch.Tensor:
        """One float per signal, 1 for the one this process received: a sum of them over the ranks
        is what :meth:`first` reads. Kept on ``device`` until a signal arrives (no copy per step)."""
        key = (self.received, device)
        if self._flags_key != key:
            self._flags = torch.tensor([float(s == self.received) for s in self.signals], device=device)
            self._flags_key = key
        return self._flags

    def first(self, counts) -> str | None:
        """The name of the first signal (in ``signals`` order) any rank received, from the flags
        summed over the ranks; None when none did."""
        for s, count in zip(self.signals, counts):
            if float(count) > 0:
                return signal.Signals(s).name
        return None
