"""The trainer's CLI with fault hooks set, for tests that run it as a subprocess (or under torchrun).

    python tests/training/_hooked_train.py [--bf16-on-cpu] [--loss-factor 3:nan,4:inf]
        [--pause-save STEP:SECONDS] [--oom-at-step N] [--cuda-graphs-on-cpu] [--report-teardown]
        [--hang-teardown SECONDS] -- TRAIN_ARGS...

Each flag sets a field of ``megatron_moe.training.fault_hooks.hooks`` (see there), then
``megatron_moe.training.train.main(TRAIN_ARGS)`` runs. ``--report-teardown`` prints a line when
the graph is released (the CPU stand-in's or, on a GPU, the real one's) and when the process
group is destroyed (their order);
``--hang-teardown S`` makes destroying the process group never return, and the trainer's
deadline for it S seconds.
"""
import argparse
import sys

from megatron_moe.training.fault_hooks import hooks


def _factors(text: str) -> dict[int, float]:
    """'3,4:inf' -> {3: nan, 4: inf} (a bare step poisons with NaN)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        at, _, kind = item.partition(":")
        out[int(at)] = float(kind or "nan")
    return out


def _report_teardown() -> None:
    import torch.distributed as dist

    from megatron_moe.training import cuda_graphs, train

    def reporting(release):  # the backend's own release still runs (on a GPU: the real graph's reset)
        def wrapped(self, graph, wait):
            print(f"teardown: graph released (wait={wait}, process group alive={dist.is_initialized()})", flush=True)
            return release(self, graph, wait)
        return wrapped

    def destroy(*args, **kwargs):
        print("teardown: process group destroyed", flush=True)
        return destroy_process_group(*args, **kwargs)

    destroy_process_group = dist.destroy_process_group
    for backend in (cuda_graphs.EagerReplay, cuda_graphs._CudaGraphs):
        backend.release = reporting(backend.release)
    train.dist.destroy_process_group = destroy


def _hang_teardown(deadline_s: float) -> None:
    import threading

    import torch.distributed as dist

    from megatron_moe.training import distributed

    distributed.TEARDOWN_DEADLINE_S = deadline_s
    dist.destroy_process_group = lambda *a, **k: threading.Event().wait()  # never returns


def apply_hooks(argv: list[str]) -> list[str]:
    """Set the hooks named in ``argv`` (up to ``--``, which torchrun drops: then the hook flags
    are picked out of the arguments); returns the trainer's arguments."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16-on-cpu", action="store_true")
    ap.add_argument("--loss-factor", type=_factors, default={})
    ap.add_argument("--pause-save")
    ap.add_argument("--oom-at-step", type=int)
    ap.add_argument("--cuda-graphs-on-cpu", action="store_true")
    ap.add_argument("--report-teardown", action="store_true")
    ap.add_argument("--hang-teardown", type=float)
    if "--" in argv:
        cut = argv.index("--")
        args, rest = ap.parse_args(argv[:cut]), argv[cut + 1:]
    else:
        args, rest = ap.parse_known_args(argv)
    hooks.bf16_on_cpu = args.bf16_on_cpu
    hooks.loss_factor_at_step = args.loss_factor
    hooks.raise_oom_at_step = args.oom_at_step
    hooks.cuda_graphs_on_cpu = args.cuda_graphs_on_cpu
    if args.report_teardown:
        _report_teardown()
    if args.hang_teardown is not None:
        _hang_teardown(args.hang_teardown)
    if args.pause_save:
        step, _, seconds = args.pause_save.partition(":")
        hooks.pause_save = (int(step), float(seconds or 0))
    return rest


if __name__ == "__main__":
    from megatron_moe.training.train import main

    sys.exit(main(apply_hooks(sys.argv[1:])))
