"""The torch.compile passes on the CPU backend: a one-process gloo group and a one-rank CPU team,
so compiled graphs hold real all-reduces for the passes to find (and, where a GPU is there, the
same suite on CUDA: the group's NCCL side and a one-rank CUDA team, so the patterns are checked
against the graphs Inductor makes for CUDA tensors too). Each test compiles a small model
and checks how many sites were rewritten, which ops the graph held before and after, and that the
outputs equal the unfused model's (the all-reduce of one rank is exact; the fused op rounds once
where the unfused graph rounds twice, so norms may differ in the last bit)."""

import os
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import tpfuse
import tpfuse.passes as passes

# The rotary embedding as engines write it natively: the end-to-end model's, so the form the
# tests fold is the form the benchmark's compiled mode runs.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "e2e"))
from model import rope  # noqa: E402

ALL_REDUCE = "_c10d_functional.all_reduce.default"
FUSED = "tpfuse.allreduce_add_rmsnorm.default"


def hand_written_rms_norm(h, weight, eps, weight_first=True):
    dtype = h.dtype
    hf = h.to(torch.float32)
    variance = hf.pow(2).mean(-1, keepdim=True)
    hf = hf * torch.rsqrt(variance + eps)
    return weight * hf.to(dtype) if weight_first else hf.to(dtype) * weight


def zero_centered_rms_norm(h, weight, eps):
    """HF transformers' GemmaRMSNorm (and Qwen3-Next's): the weight stored around 0."""
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(h)


def norm_weights(fusion):
    """norm_weight of every fused add + RMSNorm call the pass left (0 where the op lacks it)."""
    return [call.get("norm_weight", 0) for g in fusion.graphs for call in g["tpfuse_calls"]
            if call["op"] == FUSED]


def init_world_of_one():
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)


class PassesInstalled(unittest.TestCase):
    """The passes installed on a one-rank team for a class's tests (test_passes_fp8_cpu.py's
    classes derive from it too); no tests of its own."""

    device = "cpu"

    @classmethod
    def make_team(cls, **options):
        (team,) = tpfuse.cpu_team(1, **options)
        return team

    @classmethod
    def setUpClass(cls):
        init_world_of_one()
        cls.team = cls.make_team()
        cls.fusion = passes.install(cls.team)
        # Every compile runs the passes (a graph-cache hit would skip them, and their counts);
        # compiled kernels stay cached, so a kernel generated again is not built again.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False

    @classmethod
    def tearDownClass(cls):
        passes.uninstall()
        cls.team.close()


class Passes(PassesInstalled):

    def on_device(self, args):
        return [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]

    def compile_and_run(self, model, *args):
        args = self.on_device(args)
        torch._dynamo.reset()
        self.fusion.stats["allreduce_add_rmsnorm"] = 0
        self.fusion.graphs.clear()
        expected = model(*[a.clone() for a in args])
        got = torch.compile(model, fullgraph=True)(*[a.clone() for a in args])
        return got, expected

    def check_rewritten(self, sites):
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], sites)
        before = [op for g in self.fusion.graphs for op in g["before"]]
        after = [op for g in self.fusion.graphs for op in g["after"]]
        self.assertEqual(before.count(ALL_REDUCE), sites)
        self.assertEqual(after.count(ALL_REDUCE), 0, after)
        self.assertEqual(after.count(FUSED), sites, after)

    def check_close(self, got, expected):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)

    def inputs(self, tokens=5, hidden=64, dtype=torch.bfloat16):
        generator = torch.Generator().manual_seed(tokens * hidden)
        x = torch.randn(tokens, hidden, generator=generator).to(dtype)
        residual = torch.randn(tokens, hidden, generator=generator).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
        return x, residual, weight

    def test_functional_all_reduce_add_hand_written_norm(self):
        for weight_first in (True, False):

            def model(x, residual, weight):
                h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
                return hand_written_rms_norm(h, weight, 1e-6, weight_first), h

            got, expected = self.compile_and_run(model, *self.inputs())
            self.check_rewritten(1)
            self.check_close(got, expected)

    def test_functional_rms_norm_any_eps_and_width(self):
        def model(x, residual, weight):
            h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
            return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, 1e-5), h

        got, expected = self.compile_and_run(model, *self.inputs(hidden=40, dtype=torch.float16))
        self.check_rewritten(1)
        self.check_close(got, expected)

    def test_in_place_all_reduce_whose_sum_is_written_back_is_left_alone(self):
        # dist.all_reduce(x) also writes the sum into x: a use the fused op cannot serve.
        def model(x, residual, weight):
            dist.all_reduce(x)
            h = residual + x
            return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, 1e-5), h

        got, expected = self.compile_and_run(model, *self.inputs())
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 0)
        self.check_close(got, expected)

    def test_without_residual(self):
        def model(x, residual, weight):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD)
            return hand_written_rms_norm(h, weight, 1e-6), h * 2

        got, expected = self.compile_and_run(model, *self.inputs())
        self.check_rewritten(1)
        self.check_close(got, expected)

    def test_every_site_of_a_two_layer_model_with_3d_activations(self):
        def model(x, residual, weight):
            for _ in range(2):
                residual = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
                x = hand_written_rms_norm(residual, weight, 1e-6) * 0.5
            return x, residual

        x, residual, weight = self.inputs(tokens=6)
        got, expected = self.compile_and_run(
            model, x.view(2, 3, 64), residual.view(2, 3, 64), weight
        )
        self.check_rewritten(2)
        self.check_close(got, expected)

    def test_a_flattened_sum_reshaped_to_the_residual(self):
        # A MoE block that all-reduces its [tokens, hidden] output and the model that adds it to
        # a [batch, seq, hidden] residual (HF transformers' MiniMax-M2), either order.
        for residual_first in (True, False):

            def model(x, residual, weight):
                reduced = funcol.all_reduce(x, "sum", dist.group.WORLD).reshape(residual.shape)
                h = residual + reduced if residual_first else reduced + residual
                return hand_written_rms_norm(h, weight, 1e-6), h

            x, residual, weight = self.inputs(tokens=6)
            got, expected = self.compile_and_run(model, x, residual.view(2, 3, 64), weight)
            self.check_rewritten(1)
            self.check_close(got, expected)
            self.assertEqual(tuple(got[1].shape), (2, 3, 64))

    def test_a_reshape_that_regroups_the_hidden_dim_is_left_alone(self):
        def model(x, residual, weight):
            h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD).reshape(residual.shape)
            return hand_written_rms_norm(h, weight, 1e-6), h

        x, residual, weight = self.inputs(tokens=4)
        # [4, 64] summed, then read as [8, 32]: rows of the sum are not rows of the norm.
        got, expected = self.compile_and_run(model, x, residual.view(8, 32), weight[:32])
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 0)
        self.check_close(got, expected)

    def test_other_patterns_are_left_alone(self):
        def model(x, residual, weight):
            # A max all-reduce, and a norm that is not over the last dim: no rewrite.
            h = funcol.all_reduce(x, "max", dist.group.WORLD) + residual
            hf = h.float()
            return (hf * torch.rsqrt(hf.pow(2).mean(0, keepdim=True) + 1e-6)).to(h.dtype), h

        got, expected = self.compile_and_run(model, *self.inputs())
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 0)
        self.check_close(got, expected)


    def test_zero_centered_norm_with_and_without_residual(self):
        def with_residual(x, residual, weight):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            return zero_centered_rms_norm(h, weight, 1e-6), h

        def without_residual(x, residual, weight):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD)
            return zero_centered_rms_norm(h, weight, 1e-6), h * 2

        for model in (with_residual, without_residual):
            got, expected = self.compile_and_run(model, *self.inputs())
            self.check_rewritten(1)
            self.assertEqual(norm_weights(self.fusion), [1])
            self.check_close(got, expected)

    def test_plain_and_zero_centered_norms_keep_to_their_own_form(self):
        def plain(x, residual, weight):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            a = hand_written_rms_norm(h, weight, 1e-6)
            h = funcol.all_reduce(a, "sum", dist.group.WORLD) + h
            return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, 1e-6), h

        got, expected = self.compile_and_run(plain, *self.inputs())
        self.check_rewritten(2)
        self.assertEqual(norm_weights(self.fusion), [0, 0])
        self.check_close(got, expected)

        def zero_centered(x, residual, weight):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            return zero_centered_rms_norm(h, weight, 1e-6), h

        got, expected = self.compile_and_run(zero_centered, *self.inputs())
        # Never a plain-weight call.
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 1)
        self.assertEqual(norm_weights(self.fusion), [1])
        after = [op for g in self.fusion.graphs for op in g["after"]]
        self.assertEqual(after.count(ALL_REDUCE), 0, after)
        self.check_close(got, expected)

    def test_each_pass_owns_its_team_counts_and_graphs(self):
        other_team = self.make_team()
        try:
            other = passes.make_pass(other_team)
            self.assertIs(torch._inductor.config.post_grad_custom_post_pass, self.fusion)
            self.assertNotEqual(other.uuid(), self.fusion.uuid())
            self.assertEqual(other.uuid(), passes.make_pass(other_team).uuid())

            def model(x, residual, weight):
                h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
                return hand_written_rms_norm(h, weight, 1e-6), h

            self.compile_and_run(model, *self.inputs())
            self.check_rewritten(1)
            self.assertEqual(other.stats["allreduce_add_rmsnorm"], 0)
            self.assertEqual(other.graphs, [])
            calls = [call for g in self.fusion.graphs for call in g["tpfuse_calls"]]
            self.assertEqual([(c["op"], c["eps"], c["algorithm"]) for c in calls],
                             [(FUSED, 1e-6, 0)])
            passes.uninstall()
            self.assertIsNone(torch._inductor.config.post_grad_custom_post_pass)
        finally:
            torch._inductor.config.post_grad_custom_post_pass = self.fusion
            other_team.close()

    def check_qk(self, model, qkv, q_weight, k_weight, sites=1):
        qkv, q_weight, k_weight = self.on_device([qkv, q_weight, k_weight])
        torch._dynamo.reset()
        self.fusion.stats["allreduce_qk_rmsnorm"] = 0
        self.fusion.graphs.clear()
        expected = model(qkv, q_weight, k_weight)
        got = torch.compile(model, fullgraph=True)(qkv, q_weight, k_weight)
        self.assertEqual(self.fusion.stats["allreduce_qk_rmsnorm"], sites)
        after = [op for g in self.fusion.graphs for op in g["after"]]
        self.assertEqual(after.count(ALL_REDUCE), 0, after)
        self.assertEqual(after.count("tpfuse.allreduce_qk_rmsnorm.default"), sites, after)
        self.check_close(got, expected)

    def test_a_static_token_count_the_team_would_send_through_nccl_stays_unfused(self):
        def model(x, residual, weight):
            residual = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            return hand_written_rms_norm(residual, weight, 1e-6), residual

        # A team whose packets carry 64 KiB: 512 rows of 64 bf16 one-shot, fewer two-shot.
        small = self.make_team(packet_bytes=64 << 10)
        self.fusion = passes.install(small)
        try:
            self.assertEqual(small.choose(600, 64, torch.bfloat16), "nccl")
            got, expected = self.compile_and_run(model, *self.inputs(tokens=600))
            self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 0)
            after = [op for g in self.fusion.graphs for op in g["after"]]
            self.assertEqual(after.count(ALL_REDUCE), 1, after)
            self.assertEqual(after.count(FUSED), 0, after)
            self.check_close(got, expected)
            # The same model at a size the team fuses is rewritten.
            self.assertEqual(small.choose(400, 64, torch.bfloat16), "oneshot")
            self.compile_and_run(model, *self.inputs(tokens=400))
            self.check_rewritten(1)
        finally:
            del self.fusion  # back to the class's pass, on the class's team
            torch._inductor.config.post_grad_custom_post_pass = self.fusion
            small.close()

    def test_minimax_qk_norm_single_split(self):
        q_size, kv_size = 256, 64

        def model(qkv, q_weight, k_weight):
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            return qk_norm(q, k, q_weight, k_weight, 1e-6) + (v * 2,)

        generator = torch.Generator().manual_seed(3)
        qkv = torch.randn(5, q_size + 2 * kv_size, generator=generator).to(torch.bfloat16)
        q_weight = (1 + 0.1 * torch.randn(q_size, generator=generator)).to(torch.bfloat16)
        k_weight = (1 + 0.1 * torch.randn(kv_size, generator=generator)).to(torch.bfloat16)
        self.check_qk(model, qkv, q_weight, k_weight)
        self.check_qk(model, qkv.view(1, 5, -1), q_weight, k_weight)

    def test_minimax_qk_norm_separate_slices(self):
        q_size, kv_size = 128, 128

        def model(qkv, q_weight, k_weight):
            q = qkv[..., :q_size]
            k = qkv[..., q_size : q_size + kv_size]
            return qk_norm(q, k, q_weight, k_weight, 1e-5)

        qkv = torch.randn(3, q_size + 2 * kv_size).to(torch.float16)
        self.check_qk(
            model, qkv, torch.ones(q_size, dtype=torch.float16), torch.ones(kv_size, dtype=torch.float16)
        )

    def check_qk_rope(self, model, args, rope_sites):
        args = self.on_device(args)
        torch._dynamo.reset()
        self.fusion.stats["allreduce_qk_rmsnorm"] = 0
        self.fusion.stats["allreduce_qk_rmsnorm_rope"] = 0
        self.fusion.graphs.clear()
        expected = model(*args)
        got = torch.compile(model, fullgraph=True)(*args)
        self.assertEqual(self.fusion.stats["allreduce_qk_rmsnorm"], 1)
        self.assertEqual(self.fusion.stats["allreduce_qk_rmsnorm_rope"], rope_sites)
        before = [op for g in self.fusion.graphs for op in g["before"]]
        after = [op for g in self.fusion.graphs for op in g["after"]]
        self.assertEqual(after.count(ALL_REDUCE), 0, after)
        self.assertEqual(after.count("tpfuse.allreduce_qk_rmsnorm.default"), 1, after)
        # Folded: the RoPE arithmetic (and the cache lookup) left the graph; else it stayed.
        for op, count in (("aten.index.Tensor", 1), ("aten.sub.Tensor", 2)):  # sub: q and k
            self.assertEqual(before.count(op), count, before)
            self.assertEqual(after.count(op), count * (1 - rope_sites), after)
        self.check_close(got, expected)

    def rope_inputs(self, tokens, q_size, kv_size, rotary_dim, seed=11):
        generator = torch.Generator().manual_seed(seed)
        qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=generator).to(torch.bfloat16)
        q_weight = (1 + 0.1 * torch.randn(q_size, generator=generator)).to(torch.bfloat16)
        k_weight = (1 + 0.1 * torch.randn(kv_size, generator=generator)).to(torch.bfloat16)
        positions = torch.randint(0, 100, (tokens,), generator=generator)
        angles = torch.rand(100, rotary_dim // 2, generator=generator) * 6.28
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # fp32 [positions, rotary_dim]
        return qkv, q_weight, k_weight, positions, cache

    def test_minimax_qk_norm_then_neox_partial_rope_is_folded(self):
        q_size, kv_size, head_dim, rotary_dim = 256, 128, 64, 32

        def model(qkv, q_weight, k_weight, positions, cache):
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = qk_norm(q, k, q_weight, k_weight, 1e-6)
            q, k = rope(positions, q, k, cache, head_dim, rotary_dim)
            return q, k, v

        self.check_qk_rope(model, self.rope_inputs(5, q_size, kv_size, rotary_dim), 1)

    def test_a_dynamic_token_count_keeps_every_site_fused(self):
        # As engines compile a decode step, the token count symbolic (torch's automatic dynamic
        # shapes: the first count compiles a static graph, the second one for any count, which
        # the third reuses): the QK norm with its RoPE and the add + RMSNorm fused in both.
        q_size, kv_size, head_dim, rotary_dim = 256, 128, 64, 32

        def model(qkv, q_weight, k_weight, positions, cache, x, residual, weight):
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = qk_norm(q, k, q_weight, k_weight, 1e-6)
            q, k = rope(positions, q, k, cache, head_dim, rotary_dim)
            residual = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            return q, k, v, hand_written_rms_norm(residual, weight, 1e-6), residual

        torch._dynamo.reset()
        for stat in self.fusion.stats:
            self.fusion.stats[stat] = 0
        self.fusion.graphs.clear()
        compiled = torch.compile(model, fullgraph=True)
        for tokens in (5, 9, 13):
            args = self.on_device(self.rope_inputs(tokens, q_size, kv_size, rotary_dim)
                                  + self.inputs(tokens=tokens, hidden=64))
            self.check_close(compiled(*args), model(*args))
        self.assertEqual(len(self.fusion.graphs), 2, "a static graph, then a dynamic one")
        for graph in self.fusion.graphs:
            self.assertEqual(graph["after"].count(ALL_REDUCE), 0, graph["after"])
            self.assertEqual(graph["after"].count(FUSED), 1, graph["after"])
            self.assertEqual(graph["after"].count("tpfuse.allreduce_qk_rmsnorm.default"), 1)
            self.assertNotIn("aten.index.Tensor", graph["after"])  # the RoPE folded in
        self.assertEqual(self.fusion.stats["allreduce_qk_rmsnorm_rope"], 2)

    def test_rope_on_a_normalized_q_used_elsewhere_is_left_alone(self):
        q_size, kv_size, head_dim, rotary_dim = 128, 64, 64, 32

        def model(qkv, q_weight, k_weight, positions, cache):
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = qk_norm(q, k, q_weight, k_weight, 1e-6)
            q_rope, k_rope = rope(positions, q, k, cache, head_dim, rotary_dim)
            return q_rope, k_rope, q * 2  # the un-rotated q is needed too

        self.check_qk_rope(model, self.rope_inputs(3, q_size, kv_size, rotary_dim), 0)


def qk_norm(q, k, q_weight, k_weight, eps, world=1):
    """MiniMax-M2's QK norm as a TP engine writes it: one all-reduce of both mean squares."""
    dtype = q.dtype
    q, k = q.float(), k.float()
    q_var = q.pow(2).mean(dim=-1, keepdim=True)
    k_var = k.pow(2).mean(dim=-1, keepdim=True)
    variance = funcol.all_reduce(torch.cat([q_var, k_var], dim=-1), "sum", dist.group.WORLD) / world
    q_var, k_var = variance.chunk(2, dim=-1)
    q = q * torch.rsqrt(q_var + eps) * q_weight
    k = k * torch.rsqrt(k_var + eps) * k_weight
    return q.to(dtype), k.to(dtype)


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class PassesOnCuda(Passes):
    """Every test above on CUDA tensors: a one-rank CUDA team over the group's NCCL side."""

    device = "cuda"

    @classmethod
    def make_team(cls, **options):
        (team,) = tpfuse.cuda_team([torch.cuda.current_device()], **options)
        return team



if __name__ == "__main__":
    unittest.main()
