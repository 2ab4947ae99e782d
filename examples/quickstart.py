"""tpfuse's Python quickstart: 2 ranks, one process each, on the CPU (no GPU needed).

    python examples/quickstart.py

Each rank makes its team from its process group, calls the fused all-reduce + residual add +
RMSNorm and checks it against float64; then it compiles a layer written the unfused way with
tpfuse's torch.compile pass installed, which puts the fused op in its place. On GPUs: an NCCL
group, torch.cuda.set_device(rank) before Team.from_group, and CUDA tensors; nothing else changes.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

WORLD, TOKENS, HIDDEN, EPS = 2, 4, 256, 1e-6


def layer(partial, residual, weight):
    """The tensor-parallel boundary as model code writes it: all-reduce, residual add, RMSNorm."""
    residual = funcol.all_reduce(partial, "sum", dist.group.WORLD) + residual
    h = residual.float()
    norm = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(residual.dtype) * weight
    return norm, residual


def rank_main(rank, store):
    import tpfuse
    import tpfuse.passes

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    team = tpfuse.Team.from_group()  # a gloo group: a CPU team over shared memory (NCCL: CUDA)

    generator = torch.Generator().manual_seed(0)  # the same numbers on every rank
    partials = [torch.randn(TOKENS, HIDDEN, generator=generator).bfloat16() for _ in range(WORLD)]
    residual = torch.randn(TOKENS, HIDDEN, generator=generator).bfloat16()
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).bfloat16()
    total = (sum(p.double() for p in partials) + residual.double()).bfloat16().double()
    expected = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()

    # The fused op: this rank's partial sum in, the norm and the new residual out.
    norm, residual_out = tpfuse.allreduce_add_rmsnorm(team, partials[rank], residual, weight, EPS)
    torch.testing.assert_close(norm.double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(residual_out.double(), total, atol=1e-2, rtol=1e-2)

    # torch.compile: the pass finds the unfused layer and calls the fused op instead.
    fusion = tpfuse.passes.install(team)
    compiled_norm, _ = torch.compile(layer, fullgraph=True)(partials[rank], residual, weight)
    assert fusion.stats["allreduce_add_rmsnorm"] == 1, fusion.stats
    torch.testing.assert_close(compiled_norm.double(), expected, atol=2e-2, rtol=2e-2)
    if rank == 0:
        fused = [op for op in fusion.graphs[0]["after"] if op.startswith("tpfuse")]
        print(f"{team}\nthe fused op and the compiled layer (now {fused}) match float64")
    dist.destroy_process_group()


if __name__ == "__main__":
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(rank_main, args=(store,), nprocs=WORLD)  # raises if any rank fails
    print("OK")
