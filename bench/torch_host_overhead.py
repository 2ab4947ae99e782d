"""Host cost of one eager call from Python, one process per GPU (issue 5's measurement):
tpfuse.allreduce_add_rmsnorm against dist.all_reduce alone and dist.all_reduce + add + RMSNorm,
at a size where the GPU work is small (1 token of 3072 bf16). Per variant: the wall time of
`calls` back-to-back eager calls divided by `calls` (the host issue rate, as the GPU keeps up),
median of `repeats`, rank 0. Needs two GPUs.

    python3 bench/torch_host_overhead.py [--calls 2000] [--repeats 7] [--out PATH | --out-dir DIR]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_path  # noqa: E402


def _rank_main(rank, world, store_path, args, queue):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    import torch.distributed as dist

    import tpfuse

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
        device_id=device,
    )
    team = tpfuse.Team.from_group()
    x = torch.randn(1, 3072, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.ones(3072, device=device, dtype=torch.bfloat16)

    def unfused():
        y = x.clone()
        dist.all_reduce(y)
        h = (y + residual).float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    variants = {
        "tpfuse.allreduce_add_rmsnorm": lambda: tpfuse.allreduce_add_rmsnorm(
            team, x, residual, weight, 1e-6
        ),
        "torch.ops.tpfuse.allreduce_add_rmsnorm": lambda: torch.ops.tpfuse.allreduce_add_rmsnorm(
            team.handle, x, residual, weight, 1e-6, 0
        ),
        "dist.all_reduce": lambda: dist.all_reduce(x.clone()),
        "dist.all_reduce+add+rmsnorm": unfused,
    }
    results = {}
    for name, call in variants.items():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e6 / args.calls)
        results[name] = statistics.median(samples)
    if rank == 0:
        queue.put(results)
    team.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    results_path.add_arguments(parser)
    args = parser.parse_args()
    world = min(torch.cuda.device_count(), 8)
    if world < 2:
        raise SystemExit(f"torch_host_overhead: needs 2 GPUs, found {world}")
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    processes = [
        context.Process(target=_rank_main, args=(r, world, store, args, queue)) for r in range(world)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(p.exitcode != 0 for p in processes):
        raise SystemExit("torch_host_overhead: a rank failed")
    results = queue.get()
    for name, us in results.items():
        print(f"{name:40s} {us:8.2f} us per eager call (wall / calls, rank 0)")
    out = results_path.reserve(args, torch.cuda.get_device_name(0), world,
                               results_path.commit(), "host-overhead")
    if out:
        record = {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "world_size": world,
            "calls": args.calls,
            "repeats": args.repeats,
            "us_per_call": results,
        }
        with open(out, "w") as file:
            json.dump(record, file, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
