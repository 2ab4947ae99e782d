"""The torch ops and passes on GPUs, one process per GPU over an NCCL process group (skipped with
fewer than two GPUs): Team.from_group, the ops against float64 and across ranks, and a compiled
layer (all-reduce + add + RMSNorm; MiniMax-M2's QK norm and partial RoPE) with the passes
installed, under CUDA graphs (mode="reduce-overhead"), against the eager unfused layer; a group of
one is refused."""

import os
import sys
import tempfile
import traceback
import unittest

import torch

# The rotary embedding as engines write it natively (the end-to-end model's).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "e2e"))
from model import rope  # noqa: E402

WORLD = min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 0


def _layer(x, residual, weight, qkv, q_weight, k_weight, q_size, kv_size, world, positions, cache):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    # attention output all-reduce + residual add + RMSNorm
    residual = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
    hf = residual.float()
    h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(residual.dtype) * weight
    # MiniMax-M2's QK norm
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    qf, kf = q.float(), k.float()
    variance = funcol.all_reduce(
        torch.cat([qf.pow(2).mean(-1, keepdim=True), kf.pow(2).mean(-1, keepdim=True)], dim=-1),
        "sum",
        dist.group.WORLD,
    ) / world
    q_var, k_var = variance.chunk(2, dim=-1)
    q = (qf * torch.rsqrt(q_var + 1e-6) * q_weight).to(qkv.dtype)
    k = (kf * torch.rsqrt(k_var + 1e-6) * k_weight).to(qkv.dtype)
    # MiniMax-M2's partial rotary embedding (64 of 128), as engines write it natively.
    q, k = rope(positions, q, k, cache, 128, 64)
    return h, residual, q, k


def _rank_main(rank, world, store_path, failures):
    try:
        for name in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
            os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed as dist

        import tpfuse
        import tpfuse.passes as passes

        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
            device_id=torch.device("cuda", rank),
        )
        # A generous peer timeout: each rank compiles the layer before its first call in it (a
        # compiling peer is not a dead one; the timeout itself is tested with short ones).
        team = tpfuse.Team.from_group(peer_timeout_seconds=600.0)
        assert team.fallback_reason == "", team.fallback_reason
        assert team.world_size == world and team.rank == rank

        generator = torch.Generator().manual_seed(7)  # the same data on every rank, sliced per rank
        tokens, hidden = 33, 3072
        inputs = [torch.randn(tokens, hidden, generator=generator) for _ in range(world)]
        residual = torch.randn(tokens, hidden, generator=generator)
        weight = 1 + 0.1 * torch.randn(hidden, generator=generator)
        device = torch.device("cuda", rank)
        x = inputs[rank].to(device, torch.bfloat16)
        res = residual.to(device, torch.bfloat16)
        w = weight.to(device, torch.bfloat16)

        # The op, each algorithm, against float64 and across ranks.
        total = sum(t.to(torch.bfloat16).double() for t in inputs) + residual.to(torch.bfloat16).double()
        rounded = total.to(torch.bfloat16).double()
        expected = rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + 1e-6)
        expected = expected * weight.to(torch.bfloat16).double()
        for algorithm in ("oneshot", "twoshot", "nccl"):
            norm, _ = tpfuse.allreduce_add_rmsnorm(team, x, res, w, 1e-6, algorithm)
            torch.testing.assert_close(norm.double().cpu(), expected, atol=4e-2, rtol=4e-2)
            gathered = [torch.empty_like(norm) for _ in range(world)]
            dist.all_gather(gathered, norm)
            for other in gathered:
                assert torch.equal(other, norm), f"{algorithm}: ranks differ"

        # The passes on a compiled model under CUDA graphs, against the eager unfused model.
        heads, kv_heads, head_dim = 48 // world, max(1, 8 // world), 128
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv = torch.randn(tokens, q_size + 2 * kv_size, device=device).to(torch.bfloat16)
        q_weight = torch.ones(q_size, device=device, dtype=torch.bfloat16)
        k_weight = torch.ones(kv_size, device=device, dtype=torch.bfloat16)
        positions = torch.randint(0, 1000, (tokens,), generator=generator).to(device)
        angles = torch.rand(1000, 32, generator=generator) * 6.28
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)  # fp32 cos | sin
        args = (x, res, w, qkv, q_weight, k_weight, q_size, kv_size, world, positions, cache)
        eager = _layer(*args)
        fusion = passes.install(team)
        # Every compile runs the passes (a graph-cache hit would skip them, and their counts);
        # compiled kernels stay cached, so ranks that generate the same code build it once.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        compiled = torch.compile(_layer, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # warm-up, record, replay
            got = compiled(*args)
        assert fusion.stats["allreduce_add_rmsnorm"] == 1, fusion.stats
        assert fusion.stats["allreduce_qk_rmsnorm"] == 1, fusion.stats
        assert fusion.stats["allreduce_qk_rmsnorm_rope"] == 1, fusion.stats
        for g, e in zip(got, eager):
            torch.testing.assert_close(g.float(), e.float(), atol=4e-2, rtol=4e-2)

        # A group of one is refused with a clear error (new_group is collective: every rank makes
        # every group).
        groups = [dist.new_group([r]) for r in range(world)]
        try:
            tpfuse.Team.from_group(groups[rank])
            raise AssertionError("a group of one was accepted")
        except ValueError as error:
            assert "needs 2 or more" in str(error), error
        team.close()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent
        failures.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


@unittest.skipIf(WORLD < 2, f"needs 2 GPUs, found {WORLD}")
class TorchOnGpus(unittest.TestCase):
    def test_ops_and_passes_one_process_per_gpu(self):
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        failures = context.SimpleQueue()
        store = os.path.join(tempfile.mkdtemp(), "store")
        processes = [
            context.Process(target=_rank_main, args=(r, WORLD, store, failures)) for r in range(WORLD)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=600)
        for process in processes:
            if process.is_alive():
                process.kill()
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        self.assertEqual(messages, [])
        self.assertTrue(all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes])


if __name__ == "__main__":
    unittest.main()
