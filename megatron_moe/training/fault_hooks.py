"""Fault injection for the tests: hooks they set to make a run fail the way real runs do.

Nothing in a normal run sets these. In-process tests set the fields of :data:`hooks` directly;
tests that start the trainer as a subprocess (to kill it, or to run it under torchrun) go
through tests/training/_hooked_train.py, which sets them and then runs the CLI.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FaultHooks:
    loss_factor_at_step: dict[int, float] = field(default_factory=dict)
    """{step (1-based): factor}: the LM loss of that step's first micro-batch is multiplied by
    the factor (NaN or Inf) before the backward, so loss and gradients are poisoned as by a real
    divergence."""
    pause_save: tuple[int, float] | None = None
    """(step, seconds): the checkpoint save of that step sleeps after its first file is written
    into the temporary folder, so a test can kill the process in the middle of the write."""
    bf16_on_cpu: bool = False
    """``train.bf16`` applies on the CPU too (it is GPU-only otherwise), to test the bf16 paths."""
    cuda_graphs_on_cpu: bool = False
    """``train.cuda_graphs`` applies on the CPU too, through cuda_graphs.EagerReplay (a stand-in
    that re-runs the captured step), to test everything around the graph."""
    raise_oom_at_step: int | None = None
    """0: the start-up, once the model is built; N >= 1: step N, before its first forward.
    There the run raises the CPU allocator's out-of-memory error (a RuntimeError with
    torch's own text), as a micro-batch too large for the memory does, without allocating any."""

    def out_of_memory(self, step: int) -> None:
        """Raise the allocator's error if ``raise_oom_at_step`` is ``step``."""
        if self.raise_oom_at_step == step:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                               "allocate memory: you tried to allocate 68719476736 bytes. Error code 12 "
                               "(Cannot allocate memory)")


hooks = FaultHooks()
