"""The QK norm at MiniMax-M2's shapes from torch, one process per GPU (issue 3's third baseline):
the unfused pattern an engine without custom kernels runs (torch eager: fp32 mean squares of q
and k, one NCCL all-reduce of both through torch.distributed, rsqrt, weights, then the native
rotate-half RoPE) against tpfuse's fused op called from torch, without and with RoPE.

    python3 bench/torch_qk_baseline.py [--tokens 1,4,16,64,256] [--out PATH | --out-dir DIR]
    python3 bench/torch_qk_baseline.py --cpu            # the smoke run the tests use (world 1)

Method (GPU): per variant, a CUDA graph of `ops` back-to-back calls, replayed; the median replay
divided by `ops` is the time per op, rank 0 (tpfuse-bench's method, so its figures sit beside
its own table). Before timing, each variant's q and k are checked against the other's: the two
compute the same thing with different roundings (relative error recorded). On the CPU: the same
comparison, and wall time per call (no graphs; smoke figures only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import _qk_norm_unfused, init_rank, run_info, run_ranks  # noqa: E402
from model import relative_error, rope  # noqa: E402
import results_path  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM, EPS, MAX_POSITION = 48, 8, 128, 64, 1e-6, 4096


def _shapes(world: int):
    """This rank's heads at TP `world` (KV heads replicated when the world has more ranks)."""
    replicas = max(1, world // KV_HEADS)
    local = SimpleNamespace(heads=HEADS // world, kv_heads=max(1, KV_HEADS // world),
                            kv_replicas=replicas)
    config = SimpleNamespace(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             rotary_dim=ROTARY_DIM, eps=EPS)
    return config, local


def _cos_sin(device) -> torch.Tensor:
    positions = torch.arange(MAX_POSITION, dtype=torch.float64)
    inverse = 5e6 ** (-torch.arange(0, ROTARY_DIM, 2, dtype=torch.float64) / ROTARY_DIM)
    angles = positions[:, None] * inverse[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


class Variants:
    """The four variants on one rank's tensors: unfused / tpfuse, without / with RoPE."""

    def __init__(self, team, group, world, tokens, device, seed):
        import torch.distributed as dist

        self.config, self.local = _shapes(world)
        c, l = self.config, self.local
        generator = torch.Generator().manual_seed(seed)
        q_size, kv_size = l.heads * c.head_dim, l.kv_heads * c.head_dim
        self.sizes = (q_size, kv_size)
        self.qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=generator).to(
            device, torch.bfloat16)
        self.w = {"q_norm": (1 + 0.1 * torch.randn(q_size, generator=generator)).to(
                      device, torch.bfloat16),
                  "k_norm": (1 + 0.1 * torch.randn(kv_size, generator=generator)).to(
                      device, torch.bfloat16)}
        self.positions = torch.randint(0, MAX_POSITION, (tokens,), generator=generator).to(device)
        self.cos_sin = _cos_sin(device)
        self.team, self.world = team, world
        self.reduce = lambda x: (dist.all_reduce(x, group=group), x)[1]

    def unfused(self, rope_on: bool):
        no_rope = lambda positions, q, k, *rest: (q, k)  # noqa: E731
        return _qk_norm_unfused(self.qkv, self.w, self.positions, self.cos_sin, self.config,
                                self.local, self.world, self.reduce,
                                rope_fn=rope if rope_on else no_rope)

    def tpfuse(self, rope_on: bool):
        import tpfuse

        c, l = self.config, self.local
        q_size, kv_size = self.sizes
        extra = {}
        if rope_on:
            extra = dict(positions=self.positions, cos_sin_cache=self.cos_sin,
                         head_dim=c.head_dim, rotary_dim=c.rotary_dim,
                         rope_style=tpfuse.RopeStyle.NEOX)
        return tpfuse.allreduce_qk_rmsnorm(
            self.team, self.qkv, self.w["q_norm"], self.w["k_norm"], q_size, kv_size,
            c.heads * c.head_dim, c.kv_heads * c.head_dim, c.eps, kv_replicas=l.kv_replicas,
            **extra)

    def all(self):
        return {"nccl+torch_eager": lambda: self.unfused(False),
                "nccl+torch_eager_rope": lambda: self.unfused(True),
                "tpfuse": lambda: self.tpfuse(False),
                "tpfuse_rope": lambda: self.tpfuse(True)}


def _time_graph(call, ops: int, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / ops)
    return statistics.median(samples)


def _time_wall(call, calls: int) -> float:
    import time

    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) * 1e6 / calls


def _rank_main(rank, world, args, store_path, queue):
    try:
        import torch.distributed as dist

        import tpfuse

        device = init_rank(rank, world, args.cpu, store_path)
        if args.cpu:
            (team,) = tpfuse.cpu_team(1)
        else:
            team = tpfuse.Team.from_group(dist.group.WORLD)
        records = []
        for tokens in args.tokens:
            variants = Variants(team, dist.group.WORLD, world, tokens, device,
                                seed=rank * 1000 + tokens)
            calls = variants.all()
            for rope_on, (unfused, fused) in ((False, ("nccl+torch_eager", "tpfuse")),
                                              (True, ("nccl+torch_eager_rope", "tpfuse_rope"))):
                reference, result = calls[unfused](), calls[fused]()
                error = max(relative_error(result[0], reference[0]),
                            relative_error(result[1], reference[1]))
                for name in (unfused, fused):
                    us = (_time_wall(calls[name], args.calls) if args.cpu else
                          _time_graph(calls[name], args.ops, args.replays))
                    records.append({"op": "allreduce_qk_rmsnorm", "impl": name, "tokens": tokens,
                                    "world_size": world, "rope": rope_on, "us": us,
                                    "rel_err_vs_other": error})
        queue.put((rank, records, None))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent
        queue.put((rank, None, traceback.format_exc()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    parser.add_argument("--tokens", type=ints, default=[1, 4, 16, 64, 256])
    parser.add_argument("--ops", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--calls", type=int, default=20, help="CPU: calls per wall-time sample")
    parser.add_argument("--world", type=int, default=0, help="ranks (default: every GPU)")
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke run (gloo, world 1)")
    results_path.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        world = 1
    else:
        if torch.cuda.device_count() < 2:
            print("needs two or more CUDA GPUs (or --cpu for the smoke run)", file=sys.stderr)
            return 2
        world = args.world or torch.cuda.device_count()
    records = run_ranks(_rank_main, world, args)
    if records is None:
        return 1
    info = dict(run_info(args.cpu, world),
                method=("wall time per eager call, CPU smoke run" if args.cpu else
                        f"CUDA graph of {args.ops} calls, median of {args.replays} replays, "
                        "us per call, rank 0"))
    for r in records:
        print(f"{r['impl']:>22} tokens {r['tokens']:>5}: {r['us']:9.2f} us "
              f"(q/k vs the other form: {r['rel_err_vs_other']:.1e})")
    out = results_path.reserve(args, info["device"], world, info["commit"], "torch-qk")
    if out:
        with open(out, "w") as file:
            json.dump({"info": info, "records": records}, file, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
