"""Does destroy_process_group return after a CUDA graph captured an NCCL all-to-all? (issue #36)

    torchrun --standalone --nproc-per-node=2 benchmarks/graph_teardown_check.py release   # graph reset first
    torchrun --standalone --nproc-per-node=2 benchmarks/graph_teardown_check.py keep      # graph still alive

Each rank captures an ``all_to_all_single`` in a CUDA graph, replays it, checks the result, then
(``release``) resets the graph as the trainer does (``MicroBatchGraph.release``) or (``keep``)
keeps it, and destroys the process group, printing how long that took. Run it under ``timeout``:
with ``keep`` the teardown is expected to hang (pytorch/pytorch#115388).
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main(mode: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    x = torch.full((world * 4,), float(rank), device="cuda")
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_to_all_single(y, x)  # warm-up: NCCL's communicator and buffers
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        dist.all_to_all_single(y, x)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.arange(world, device="cuda").repeat_interleave(4).float()
    assert torch.equal(y, want), (y, want)
    if mode == "release":  # the GPU is idle (synchronised above), as the trainer's release waits for
        graph.reset()
    t0 = time.perf_counter()
    dist.destroy_process_group()
    print(f"rank {rank} ({mode}): destroy_process_group returned in {time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "release")
