"""CPU tensor parallelism, one process a rank: tpfuse's fused all-reduce + add + RMSNorm over its
shared-memory CPU team against what a CPU engine runs without it, gloo's all-reduce and then the
local add + RMSNorm (tpfuse's local kernel, and torch's eager ops).

    python3 bench/cpu_processes.py --world 2,4 --out-dir tpfuse-results

Impls (the same inputs, bf16, every rank):
  tpfuse                 tpfuse.allreduce_add_rmsnorm on Team.from_group(gloo group): two new
                         output tensors a call
  tpfuse_                tpfuse.allreduce_add_rmsnorm_ on the same team, in place into the caller's
                         input and residual (as engines call a fused add + RMSNorm)
  gloo+tpfuse_local      dist.all_reduce (gloo, on a copy) + the fused add + RMSNorm of a one-rank
                         team (tpfuse's local kernel)
  gloo+torch             dist.all_reduce + torch's residual add and F.rms_norm (eager)

Method: per shape, every rank starts each replay together (a barrier), runs `--calls` calls back to
back timed with time.perf_counter, and the median replay / calls is reported: rank 0's as `us`,
the slowest rank's as `us_max_rank`. `minor_faults` is rank 0's page faults per call over the
timed calls (getrusage): what a call's fresh allocations cost when the allocator hands back
untouched pages. Every impl's output is compared with tpfuse's
(`max_abs_diff`). These are CPU figures; they depend on the host's cores (recorded) and on ranks
not outnumbering them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e"))
import decode  # noqa: E402  -- its run_ranks spawns the ranks
import results_path  # noqa: E402

IMPLS = ("tpfuse", "tpfuse_", "gloo+tpfuse_local", "gloo+torch")


def _host_cpu():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _rank_main(rank, world, args, store_path, queue):
    try:
        import torch.distributed as dist
        import torch.nn.functional as F

        import tpfuse

        torch.set_num_threads(1)  # one core a rank, as a TP rank pinned to its cores would run
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        team = tpfuse.Team.from_group()
        (local,) = tpfuse.cpu_team(1)
        eps = 1e-6
        records = []
        for hidden in args.hidden:
            generator = torch.Generator().manual_seed(hidden * 131 + rank)
            weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(5)))
            weight = weight.to(torch.bfloat16)
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
                residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(
                    tokens)).to(torch.bfloat16)

                def fused():
                    return tpfuse.allreduce_add_rmsnorm(team, x, residual, weight, eps)[0]

                # The in-place op overwrites its operands, so it runs on copies made once: the
                # timed calls feed each call's outputs to the next, as a decoder's layers do.
                x_inplace, residual_inplace = x.clone(), residual.clone()

                def fused_inplace():
                    tpfuse.allreduce_add_rmsnorm_(team, x_inplace, residual_inplace, weight, eps)
                    return x_inplace

                def gloo_local():
                    total = x.clone()
                    dist.all_reduce(total)
                    return tpfuse.allreduce_add_rmsnorm(local, total, residual, weight, eps)[0]

                def gloo_torch():
                    total = x.clone()
                    dist.all_reduce(total)
                    h = total + residual
                    return F.rms_norm(h.float(), (hidden,), eps=eps).to(h.dtype) * weight

                reference = fused()
                for impl, call in zip(IMPLS, (fused, fused_inplace, gloo_local, gloo_torch)):
                    out = call().clone()  # warm-up, and the output compared with tpfuse's
                    per_op = []
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    for _ in range(args.replays):
                        dist.barrier()
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            call()
                        per_op.append((time.perf_counter() - start) / args.calls * 1e6)
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                    us = statistics.median(per_op)
                    every = [None] * world
                    dist.all_gather_object(every, us)
                    records.append({
                        "op": "allreduce_add_rmsnorm", "impl": impl, "hidden": hidden,
                        "tokens": tokens, "world_size": world, "dtype": "bf16", "us": us,
                        "us_max_rank": max(every),
                        "max_abs_diff": float((out.float() - reference.float()).abs().max()),
                        "minor_faults": faults / (args.replays * args.calls),
                    })
        team.close()
        local.close()
        dist.destroy_process_group()
        queue.put((rank, records, None))
    except Exception:  # noqa: BLE001 -- reported to the parent
        queue.put((rank, None, traceback.format_exc()))


def run_world(world, args):
    records = decode.run_ranks(_rank_main, world, args)  # prints every rank's error
    if records is None:
        raise RuntimeError(f"a rank of world {world} failed (its error is above)")
    return records


def print_table(records):
    tpfuse_impls = [i for i in IMPLS if i.startswith("tpfuse")]
    baselines = [i for i in IMPLS if i not in tpfuse_impls]
    for world in sorted({r["world_size"] for r in records}):
        for hidden in sorted({r["hidden"] for r in records}):
            rows = [r for r in records if r["world_size"] == world and r["hidden"] == hidden]
            print(f"\nallreduce_add_rmsnorm, hidden {hidden}, bf16, world {world} (cpu processes): "
                  "us per op (page faults per call), rank 0")
            print(f"{'tokens':>8}" + "".join(f"{impl:>24}" for impl in IMPLS) + f"{'speedup':>10}")
            for tokens in sorted({r["tokens"] for r in rows}):
                by_impl = {r["impl"]: r for r in rows if r["tokens"] == tokens}
                best_tpfuse = min(by_impl[i]["us"] for i in tpfuse_impls)
                best_other = min(by_impl[i]["us"] for i in baselines)
                cells = "".join(
                    f"{by_impl[i]['us']:>15.2f} ({by_impl[i]['minor_faults']:>5.0f})" for i in IMPLS)
                print(f"{tokens:>8}{cells}{best_other / best_tpfuse:>9.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    parser.add_argument("--world", type=ints, default=[2])
    parser.add_argument("--hidden", type=ints, default=[3072, 7168])
    parser.add_argument("--tokens", type=ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per replay")
    parser.add_argument("--replays", type=int, default=15)
    results_path.add_arguments(parser)
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    info = {
        "device": "cpu", "host_cpu": _host_cpu(), "cores": cores, "torch": torch.__version__,
        "commit": results_path.commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "method": f"{args.calls} back-to-back calls per replay (time.perf_counter), median of "
                  f"{args.replays} replays started together; one torch thread a rank",
    }
    records = []
    for world in args.world:
        if world > cores:
            print(f"note: world {world} is more ranks than this host's {cores} cores",
                  file=sys.stderr)
        records += run_world(world, args)
    print_table(records)
    out = results_path.reserve(args, "cpu", max(args.world), info["commit"], "cpu-processes")
    if out:
        with open(out, "w") as file:
            json.dump({"info": info, "records": records}, file, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
