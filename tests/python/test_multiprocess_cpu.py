"""The torch path across processes on the CPU: one process per rank over a gloo group at world
sizes 2, 4 and 8, the team from ``Team.from_group`` (the CPU backend over shared memory). Each
rank checks the ops against float64 and against every other rank's bits, then compiles a layer
written as TP model code writes it (all-reduce + add + RMSNorm, MiniMax-M2's QK norm over KV heads
replicated when they are fewer than the ranks, its partial RoPE, a MoE block's combine before its
all-reduce and the norm after it quantized to FP8 per group of 128) with the passes installed: every
site rewritten, no all-reduce left, outputs close to the eager unfused layer's, the residual stream
identical on every rank and k identical on the ranks that hold the same KV head. The team outlives
its group; bad groups and backends are named."""

import os
import sys
import tempfile
import traceback
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "e2e"))
from model import rope  # noqa: E402
from spawned_ranks import run_ranks  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM, HIDDEN, TOKENS = 8, 2, 64, 32, 256, 5
PEER_TIMEOUT_SECONDS = 600.0


def _layer(x, residual, weight, qkv, q_weight, k_weight, q_size, kv_size, world, positions, cache,
           rows, routing):
    """One collective site of each kind, as a TP model writes it (the GPU test's layer, and a MoE
    block's: its top-k rows combined, all-reduced, added, normalized and quantized to FP8 per
    group of 128 for the next FP8 GEMM)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import tpfuse.passes

    residual = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
    hf = residual.float()
    h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(residual.dtype) * weight
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
    q, k = rope(positions, q, k, cache, HEAD_DIM, ROTARY_DIM)
    partial = (rows.float() * routing.unsqueeze(-1)).sum(1).to(rows.dtype)
    moe_residual = funcol.all_reduce(partial, "sum", dist.group.WORLD) + residual
    hf = moe_residual.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(residual.dtype) * weight
    q8, scales = tpfuse.passes.quant_fp8_group(n)
    return h, residual, q, k, n, moe_residual, q8, scales


def _gathered(tensor, world):
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous())
    return out


def _check_ops(team, rank, world):
    import torch.distributed as dist

    import tpfuse

    generator = torch.Generator().manual_seed(7)  # the same data on every rank, sliced per rank
    inputs = [torch.randn(TOKENS, HIDDEN, generator=generator) for _ in range(world)]
    residual = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(torch.bfloat16)
    x = inputs[rank].to(torch.bfloat16)
    total = sum(t.to(torch.bfloat16).double() for t in inputs) + residual.double()
    rounded = total.to(torch.bfloat16).double()
    expected = rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = expected * weight.double()
    bits = None
    for algorithm in ("oneshot", "twoshot", "nccl", "auto"):
        poison = torch.full_like(x, float("nan"))
        norm, residual_out = tpfuse.allreduce_add_rmsnorm(team, x, residual, weight, 1e-6,
                                                          algorithm)
        assert not torch.equal(norm, poison)
        torch.testing.assert_close(norm.double(), expected, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(residual_out.double(), total, atol=3e-2, rtol=1e-2)
        for other in _gathered(norm, world):
            assert torch.equal(other, norm), f"{algorithm}: ranks' norms differ"
        if algorithm in ("oneshot", "twoshot"):  # one rounding: the same bits
            bits = norm if bits is None else bits
            assert torch.equal(norm, bits), f"{algorithm} differs from one-shot"
    # In place: input <- norm, residual <- the sum; the functional op's bits.
    x_copy, residual_copy = x.clone(), residual.clone()
    tpfuse.allreduce_add_rmsnorm_(team, x_copy, residual_copy, weight, 1e-6, "oneshot")
    assert torch.equal(x_copy, bits)
    # The FP8 output per group of 128: the same bytes and scales on every rank, each scale the
    # group's amax / 448 of the norm as stored.
    norm, _, quant_out, scales = tpfuse.allreduce_add_rmsnorm_fp8(
        team, x, residual, weight, 1e-6, "per_token_group_128")
    assert torch.equal(norm, bits)
    expected_scales = norm.float().reshape(TOKENS, -1, 128).abs().amax(-1).clamp(min=1e-10) / 448
    assert torch.equal(scales, expected_scales)
    for other in _gathered(quant_out.view(torch.uint8), world):
        assert torch.equal(other, quant_out.view(torch.uint8)), "FP8 bytes differ across ranks"
    # The MoE finalize: every algorithm gives the plain op's bits on torch's combine.
    rows = torch.randn(TOKENS, 3, HIDDEN, generator=generator).to(torch.bfloat16)
    routing = torch.rand(TOKENS, 3, generator=generator)
    products = rows.float() * routing.unsqueeze(-1)
    combined = (products[:, 0] + products[:, 1] + products[:, 2]).to(torch.bfloat16)
    for algorithm in ("oneshot", "twoshot", "nccl"):
        fused = tpfuse.allreduce_moe_finalize_add_rmsnorm(team, rows, routing, residual, weight,
                                                          1e-6, algorithm=algorithm)
        plain = tpfuse.allreduce_add_rmsnorm(team, combined, residual, weight, 1e-6, algorithm)
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1]), algorithm
        for other in _gathered(fused[0], world):
            assert torch.equal(other, fused[0]), f"{algorithm}: ranks' MoE norms differ"
    dist.barrier()


def _qkv_slices(rank, world, generator):
    """This rank's packed [q | k | v] of a layer with HEADS query and KV_HEADS KV heads: its query
    heads, and its KV head (replicated over world / KV_HEADS ranks when KV heads are fewer)."""
    q_global = torch.randn(TOKENS, HEADS * HEAD_DIM, generator=generator)
    k_global = torch.randn(TOKENS, KV_HEADS * HEAD_DIM, generator=generator)
    v_global = torch.randn(TOKENS, KV_HEADS * HEAD_DIM, generator=generator)
    heads = HEADS // world
    kv_heads = max(1, KV_HEADS // world)
    replicas = max(1, world // KV_HEADS)
    first_kv = (rank // replicas) * kv_heads
    q = q_global[:, rank * heads * HEAD_DIM:(rank + 1) * heads * HEAD_DIM]
    k = k_global[:, first_kv * HEAD_DIM:(first_kv + kv_heads) * HEAD_DIM]
    v = v_global[:, first_kv * HEAD_DIM:(first_kv + kv_heads) * HEAD_DIM]
    return torch.cat([q, k, v], dim=-1).to(torch.bfloat16), heads * HEAD_DIM, kv_heads * HEAD_DIM


def _check_compiled_layer(team, rank, world):
    import tpfuse.passes as passes

    generator = torch.Generator().manual_seed(11)
    inputs = [torch.randn(TOKENS, HIDDEN, generator=generator) for _ in range(world)]
    residual = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(torch.bfloat16)
    qkv, q_size, kv_size = _qkv_slices(rank, world, generator)
    q_weight = (1 + 0.1 * torch.randn(q_size, generator=generator)).to(torch.bfloat16)
    k_weight = (1 + 0.1 * torch.randn(kv_size, generator=generator)).to(torch.bfloat16)
    positions = torch.randint(0, 1000, (TOKENS,), generator=generator)
    angles = torch.rand(1000, ROTARY_DIM // 2, generator=generator) * 6.28
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    rows = torch.randn(world, TOKENS, 4, HIDDEN, generator=generator)[rank].to(torch.bfloat16)
    routing = torch.rand(world, TOKENS, 4, generator=generator)[rank] / 2
    args = (inputs[rank].to(torch.bfloat16), residual, weight, qkv, q_weight, k_weight, q_size,
            kv_size, world, positions, cache, rows, routing)
    eager = _layer(*args)
    fusion = passes.install(team)
    try:
        torch._dynamo.reset()
        got = torch.compile(_layer, fullgraph=True)(*args)
    finally:
        passes.uninstall()
    rewrites = {name: count for name, count in fusion.stats.items() if count}
    assert rewrites == {"allreduce_add_rmsnorm": 1, "allreduce_qk_rmsnorm": 1,
                        "allreduce_qk_rmsnorm_rope": 1, "allreduce_moe_finalize_add_rmsnorm": 1,
                        "allreduce_add_rmsnorm_fp8_group128": 1}, fusion.stats
    (graph,) = fusion.graphs
    assert graph["before"].count("_c10d_functional.all_reduce.default") == 3, graph["before"]
    assert "_c10d_functional.all_reduce.default" not in graph["after"], graph["after"]
    assert "tpfuse.allreduce_moe_finalize_add_rmsnorm_fp8.default" in graph["after"]
    for g, e in zip(got[:6], eager[:6]):
        torch.testing.assert_close(g.float(), e.float(), atol=4e-2, rtol=4e-2)
    # FP8: close to the eager layer's (its norm may differ in the last bits: the combine is summed
    # in another order, and a sum near zero makes that large), and
    # exactly the torch quantization of the compiled layer's own norm.
    h, residual_out, q, k, n, moe_residual, q8, scales = got
    want_q8, want_scales = passes.quant_fp8_group(n)
    assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    dequantized = (q8.float().unflatten(-1, (-1, 128)) * scales).flatten(-2)
    eager_dequantized = (eager[6].float().unflatten(-1, (-1, 128)) * eager[7]).flatten(-2)
    torch.testing.assert_close(dequantized, eager_dequantized, atol=4e-2, rtol=0.13)
    for name, tensor in (("h", h), ("residual", residual_out), ("MoE norm", n),
                         ("MoE residual", moe_residual), ("FP8 output", q8.view(torch.uint8)),
                         ("FP8 scales", scales)):
        for other in _gathered(tensor, world):
            assert torch.equal(other, tensor), f"the compiled layer's {name} differs across ranks"
    replicas = max(1, world // KV_HEADS)
    for other_rank, other in enumerate(_gathered(k, world)):
        if other_rank // replicas == rank // replicas:
            assert torch.equal(other, k), f"k differs between ranks {rank} and {other_rank}"


def _rank_main(rank, world, store_path, failures):
    try:
        import torch.distributed as dist

        import tpfuse

        # Every compile runs the passes (a graph-cache hit would skip them, and their counts);
        # compiled kernels stay cached, so ranks that generate the same code build it once.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        # A generous peer timeout: each rank compiles the layer before its first call in it, and
        # on a loaded machine one rank may get there many seconds after another (the timeout
        # itself is tested with short ones in test_torch_ops_cpu.py and the C++ tests).
        team = tpfuse.Team.from_group(peer_timeout_seconds=PEER_TIMEOUT_SECONDS)
        assert (team.rank, team.world_size) == (rank, world), team
        assert team.peer_memory == "shared memory" and team.fallback_reason == "", team
        _check_ops(team, rank, world)
        _check_compiled_layer(team, rank, world)
        # Wrong backends are named before anything is made. backend='cuda' over this gloo group
        # is refused for what the machine lacks: CUDA itself where there is none; else, whatever
        # the number of GPUs, a GPU a rank, since no rank here chose one (every rank is on
        # cuda:0).
        if torch.cuda.is_available():
            cuda_refusal = "both use cuda:0; call torch.cuda.set_device(<this rank's GPU>) first"
        else:
            cuda_refusal = "backend 'cuda' needs CUDA"
        for backend, message in (("tpu", "backend must be 'cuda' or 'cpu'"),
                                 ("cuda", cuda_refusal)):
            try:
                tpfuse.Team.from_group(backend=backend)
                raise AssertionError(f"backend {backend!r} was accepted")
            except (ValueError, RuntimeError) as error:
                assert message in str(error), error
        # The team needs its group only while it is made.
        dist.destroy_process_group()
        x = torch.full((2, HIDDEN), float(rank + 1), dtype=torch.bfloat16)
        total = tpfuse.allreduce(team, x)
        assert torch.equal(total, torch.full_like(x, world * (world + 1) / 2)), total
        # A released team is named as such, by its handle and through the closed Team.
        handle = team.handle
        team.close()
        team.close()  # twice is harmless
        for call in (lambda: torch.ops.tpfuse.allreduce(handle, x, 0),
                     lambda: tpfuse.allreduce(team, x)):
            try:
                call()
                raise AssertionError("a released team was accepted")
            except RuntimeError as error:
                assert "is not a live team handle" in str(error), error
    except Exception:  # noqa: BLE001 -- reported to the parent
        failures.put(f"rank {rank}:\n{traceback.format_exc()}")


class CpuProcessesBench(unittest.TestCase):
    """bench/cpu_processes.py in its smallest form: every impl measured, outputs close."""

    def test_every_impl_is_measured_and_agrees_with_tpfuse(self):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
        import cpu_processes

        out = os.path.join(tempfile.mkdtemp(), "cpu.json")
        self.assertEqual(cpu_processes.main([
            "--world", "2", "--hidden", "256", "--tokens", "1,3", "--calls", "2",
            "--replays", "2", "--out", out]), 0)
        import json

        with open(out) as file:
            records = json.load(file)["records"]
        self.assertEqual(len(records), 2 * len(cpu_processes.IMPLS))
        for record in records:
            self.assertGreater(record["us"], 0.0)
            self.assertGreaterEqual(record["us_max_rank"], record["us"])
            self.assertGreaterEqual(record["minor_faults"], 0.0)
            if record["impl"] == "tpfuse_":
                # The in-place op's first call, on copies of the same operands: the same bits.
                self.assertEqual(record["max_abs_diff"], 0.0, record)
            else:
                # Two roundings (gloo's sum, then the add) where tpfuse rounds once: a few bf16
                # steps.
                self.assertLess(record["max_abs_diff"], 0.1, record)


class MultiProcessCpu(unittest.TestCase):
    def test_world_2(self):
        run_ranks(self, _rank_main, 2)

    def test_world_4(self):
        run_ranks(self, _rank_main, 4)

    def test_world_8(self):
        run_ranks(self, _rank_main, 8)


if __name__ == "__main__":
    unittest.main()
