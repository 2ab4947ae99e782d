"""The passes' FP8 stage on the CPU backend (and, where a GPU is there, on CUDA): a fused add +
RMSNorm whose norm output model code then quantizes to FP8 E4M3 in torch ops (per tensor with a
static scale, per token, per token group of 128) becomes one tpfuse::allreduce_add_rmsnorm_fp8.

Each test compiles a small model and checks the rewrites counted, the ops the graph held before
and after, and the numbers: the norm and the residual as in test_passes_cpu.py (close to the eager
model's), and the FP8 output and its scales exactly equal to the defined quantization (IEEE
divisions; on the CPU that is torch's eager one too) of the compiled model's own norm output (the op
quantizes the rounded norm as stored; the eager model's norm may differ from it in the last bit, so
its FP8 bytes are compared as values)."""

import os
import sys
import unittest

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(__file__))
import test_passes_cpu as base  # noqa: E402  -- a module: its test classes are not run here

import tpfuse  # noqa: E402
import tpfuse.passes as passes  # noqa: E402

ALL_REDUCE = base.ALL_REDUCE
FUSED = base.FUSED
FUSED_FP8 = "tpfuse.allreduce_add_rmsnorm_fp8.default"
QUANT_OPS = ("aten.amax.default", "aten.clamp_min.default", "aten.clamp_max.default",
             "aten.div.Tensor", "aten.clamp.default")
FP8 = torch.float8_e4m3fn

# mode -> (the quantization as model code writes it, the stat, the op's quant)
MODES = {
    "static": (lambda n, scale: passes.quant_fp8_static(n, scale), "allreduce_add_rmsnorm_fp8", 1),
    "per_token": (lambda n, scale: passes.quant_fp8_per_token(n), "allreduce_add_rmsnorm_fp8_token",
                  2),
    "group128": (lambda n, scale: passes.quant_fp8_group(n), "allreduce_add_rmsnorm_fp8_group128",
                 3),
}


def vllm_rms_norm(h, weight, eps):
    """vLLM's RMSNorm.forward_native: the weight applied after the cast back."""
    return base.hand_written_rms_norm(h, weight, eps, weight_first=False)


def as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


def defined_quantization(mode, norm, static_scale):
    """The FP8 output and scales by their definition, the same on every device: each division
    IEEE (a float64 quotient rounded once to float32 is the correctly rounded float32 one),
    saturated to +-448, rounded to nearest even. torch's CUDA kernels divide by a Python number
    as a product with its reciprocal, so there the model code's own scales may differ from these
    in the last bit; on the CPU they are equal (check_quantized asserts both)."""

    def divide(values, scale):
        quotient = (values.double() / scale.double()).float()
        return quotient.clamp(-448.0, 448.0).to(FP8)

    values = norm.float()
    if mode == "static":
        return (divide(values, static_scale),)
    if mode == "group128":
        values = values.reshape(*norm.shape[:-1], norm.shape[-1] // 128, 128)
    amax = values.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    scale = (amax.double() / 448.0).float()
    return divide(values, scale).reshape(norm.shape), scale


class _OneRankPasses(base.PassesInstalled):
    """The passes installed on a one-rank team; compiles, checks, no tests of its own."""

    def inputs(self, tokens=5, hidden=384, lead=None):
        generator = torch.Generator().manual_seed(tokens * hidden + 7)
        shape = (tokens, hidden) if lead is None else (*lead, hidden)
        x = torch.randn(shape, generator=generator).to(torch.bfloat16)
        residual = torch.randn(shape, generator=generator).to(torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(torch.bfloat16)
        scale = torch.tensor([0.0173], dtype=torch.float32)
        return [a.to(self.device) for a in (x, residual, weight, scale)]

    def compile_and_run(self, model, args):
        torch._dynamo.reset()
        for stat in self.fusion.stats:
            self.fusion.stats[stat] = 0
        self.fusion.graphs.clear()
        expected = model(*[a.clone() for a in args])
        got = torch.compile(model, fullgraph=True)(*[a.clone() for a in args])
        return got, expected

    def ops(self, which):
        return [op for g in self.fusion.graphs for op in g[which]]

    def check_fused(self, stat, quant, keep_norm, column_major_scales=False):
        """One site fused into the FP8 form, which writes the bf16 norm only where `keep_norm`
        (something besides the quantization reads it)."""
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 1)
        self.assertEqual(self.fusion.stats[stat], 1)
        others = [s for s in self.fusion.stats if s.startswith("allreduce_add_rmsnorm_fp8")]
        self.assertEqual(sum(self.fusion.stats[s] for s in others), 1, self.fusion.stats)
        before, after = self.ops("before"), self.ops("after")
        self.assertEqual(before.count(ALL_REDUCE), 1)
        self.assertIn("aten.amax.default" if quant != 1 else "aten.clamp_max.default", before)
        self.assertEqual(after.count(ALL_REDUCE), 0, after)
        self.assertEqual(after.count(FUSED), 0, after)
        self.assertEqual(after.count(FUSED_FP8), 1, after)
        for op in QUANT_OPS:
            self.assertNotIn(op, after)
        calls = [c for g in self.fusion.graphs for c in g["tpfuse_calls"]]
        self.assertEqual(
            [(c["op"], c["quant"], c["column_major_scales"], c["keep_norm"]) for c in calls],
            [(FUSED_FP8, quant, column_major_scales, keep_norm)])

    def fused_norm(self, x, residual, weight, eps):
        """The norm output tpfuse's bf16 fused op gives for these inputs (one rank: x is the
        sum): what the FP8 op quantizes."""
        rows = lambda t: t.reshape(-1, t.shape[-1]) if t is not None else None  # noqa: E731
        norm, _ = tpfuse.allreduce_add_rmsnorm(self.team, rows(x), rows(residual), weight, eps)
        return norm.view(x.shape)

    def check_quantized(self, mode, norm, q, s, expected_q, expected_s, scale):
        """q, s: exactly the defined quantization of the fused op's norm (`norm`), which on the
        CPU is also torch's; close to the eager model's, which rounds its norm twice and may land
        one E4M3 step away."""
        want = defined_quantization(mode, norm, scale)
        if norm.device.type == "cpu":
            torch_quantized = as_tuple(MODES[mode][0](norm, scale))
            for mine, theirs in zip(want, torch_quantized):
                self.assertTrue(torch.equal(mine.view(torch.uint8) if mine.dtype == FP8 else mine,
                                            theirs.view(torch.uint8)
                                            if theirs.dtype == FP8 else theirs))
        self.assertEqual(q.dtype, FP8)
        self.assertEqual(q.shape, norm.shape)
        self.assertTrue(torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)))
        if s is None:
            s, expected_s = scale, scale
        else:
            self.assertEqual(s.dtype, torch.float32)
            self.assertEqual(s.shape, want[1].shape)
            self.assertTrue(torch.equal(s, want[1]))
            torch.testing.assert_close(s, expected_s, atol=0, rtol=2e-2)
        got, exp = q.float(), expected_q.float()
        if mode == "group128":
            got, exp = got.unflatten(-1, (-1, 128)), exp.unflatten(-1, (-1, 128))
        torch.testing.assert_close(got * s, exp * expected_s, atol=1e-3, rtol=0.13)


class PassesFp8(_OneRankPasses):
    """The FP8 stage: each quantization mode folded in, and what is left alone."""

    def test_every_mode_with_the_norm_used_elsewhere_too(self):
        # MiniMax-M2's post-attention norm: the router reads it in bf16, the experts in FP8.
        for mode, (quantize, stat, quant) in MODES.items():
            for lead in (None, (2, 3)):
                with self.subTest(mode=mode, lead=lead):

                    def model(x, residual, weight, scale):
                        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
                        n = vllm_rms_norm(h, weight, 1e-6)
                        return (n, h, *as_tuple(quantize(n, scale)))

                    args = self.inputs(tokens=6, lead=lead)
                    got, expected = self.compile_and_run(model, args)
                    self.check_fused(stat, quant, keep_norm=True)
                    base.Passes.check_close(self, got[:2], expected[:2])
                    s, es = (got[3], expected[3]) if mode != "static" else (None, None)
                    norm = self.fused_norm(*args[:3], 1e-6)
                    self.assertTrue(torch.equal(got[0], norm))
                    self.check_quantized(mode, norm, got[2], s, expected[2], es, args[3])

    def test_every_mode_with_only_the_fp8_output_read(self):
        for mode, (quantize, stat, quant) in MODES.items():
            for weight_first in (True, False):
                with self.subTest(mode=mode, weight_first=weight_first):

                    def model(x, residual, weight, scale):
                        h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
                        n = base.hand_written_rms_norm(h, weight, 1e-5, weight_first)
                        return (h, *as_tuple(quantize(n, scale)))

                    args = self.inputs(tokens=7, hidden=256)
                    got, expected = self.compile_and_run(model, args)
                    # Nothing reads the bf16 norm: the op writes the FP8 output alone.
                    self.check_fused(stat, quant, keep_norm=False)
                    norm = self.fused_norm(args[0], args[1], args[2], 1e-5)
                    s, es = (got[2], expected[2]) if mode != "static" else (None, None)
                    self.check_quantized(mode, norm, got[1], s, expected[1], es, args[3])
                    base.Passes.check_close(self, got[:1], expected[:1])

    def test_every_mode_with_a_dynamic_token_count(self):
        # As engines compile a decode step: the token dim symbolic, the width fixed. torch's
        # automatic dynamic shapes: the first count compiles a static graph, the second one graph
        # for any count, which the third reuses; every graph fused, no bf16 norm written.
        for mode, (quantize, stat, quant) in MODES.items():
            with self.subTest(mode=mode):

                def model(x, residual, weight, scale):
                    h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
                    n = base.hand_written_rms_norm(h, weight, 1e-5, True)
                    return (h, *as_tuple(quantize(n, scale)))

                torch._dynamo.reset()
                self.fusion.graphs.clear()
                compiled = torch.compile(model, fullgraph=True)
                for tokens in (5, 9, 13):
                    args = self.inputs(tokens=tokens, hidden=384)
                    got = compiled(*[a.clone() for a in args])
                    expected = model(*[a.clone() for a in args])
                    norm = self.fused_norm(args[0], args[1], args[2], 1e-5)
                    s, es = (got[2], expected[2]) if mode != "static" else (None, None)
                    self.check_quantized(mode, norm, got[1], s, expected[1], es, args[3])
                    base.Passes.check_close(self, got[:1], expected[:1])
                self.assertEqual(len(self.fusion.graphs), 2, "a static graph, then a dynamic one")
                for graph in self.fusion.graphs:
                    self.assertEqual([(c["op"], c["quant"], c["keep_norm"])
                                      for c in graph["tpfuse_calls"]], [(FUSED_FP8, quant, False)])
                    for op in QUANT_OPS:
                        self.assertNotIn(op, graph["after"])

    def test_group_scales_read_column_major_are_written_so(self):
        # s.t().contiguous().t(): the layout torch's block-scaled FP8 GEMM takes. The op writes
        # the scales column-major and the copy leaves the graph, unless the scales are also read
        # as they are (then the op keeps them row-major and the copy stays).
        for also_row_major in (False, True):
            with self.subTest(also_row_major=also_row_major):

                def model(x, residual, weight, scale):
                    h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
                    n = base.hand_written_rms_norm(h, weight, 1e-5, True)
                    q, s = passes.quant_fp8_group(n)
                    s = s.squeeze(-1)
                    out = (h, q, s.t().contiguous().t())
                    return out + (s * 2,) if also_row_major else out

                args = self.inputs(tokens=6, hidden=384)
                got, expected = self.compile_and_run(model, args)
                self.check_fused("allreduce_add_rmsnorm_fp8_group128", 3, keep_norm=False,
                                 column_major_scales=not also_row_major)
                after = self.ops("after")
                self.assertEqual(after.count("aten.clone.default"), int(also_row_major), after)
                norm = self.fused_norm(args[0], args[1], args[2], 1e-5)
                want_q, want_s = defined_quantization("group128", norm, None)
                self.assertTrue(torch.equal(got[1].view(torch.uint8), want_q.view(torch.uint8)))
                self.assertEqual(got[2].stride(), (1, 6))
                self.assertTrue(torch.equal(got[2], want_s.squeeze(-1)))
                if also_row_major:
                    self.assertTrue(torch.equal(got[3], want_s.squeeze(-1) * 2))

    def test_without_residual(self):
        def model(x, residual, weight, scale):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD)
            n = vllm_rms_norm(h, weight, 1e-6)
            q, s = passes.quant_fp8_group(n)
            return n, h * 2, q, s

        args = self.inputs()
        got, expected = self.compile_and_run(model, args)
        self.check_fused("allreduce_add_rmsnorm_fp8_group128", 3, keep_norm=True)
        norm = self.fused_norm(args[0], None, args[2], 1e-6)
        self.check_quantized("group128", norm, got[2], got[3], expected[2], expected[3], args[3])

    def check_left_alone(self, model, args, norm_fused=1):
        got, expected = self.compile_and_run(model, args)
        fp8 = [s for s in self.fusion.stats if s.startswith("allreduce_add_rmsnorm_fp8")]
        self.assertEqual(sum(self.fusion.stats[s] for s in fp8), 0, self.fusion.stats)
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], norm_fused)
        after = self.ops("after")
        self.assertEqual(after.count(FUSED_FP8), 0, after)
        self.assertEqual(after.count(FUSED), norm_fused, after)
        for g, e in zip(got, expected):
            if g.dtype == FP8:
                # Within one E4M3 step: the fused norm may differ from the eager one in the last bit.
                torch.testing.assert_close(g.float(), e.float(), atol=1e-3, rtol=0.13)
            else:
                torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)

    def test_quantizations_of_other_numerics_are_left_alone(self):
        def reciprocal(n, scale):  # a multiply by 1 / scale rounds differently from a divide
            return (n.float() * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8)

        def other_floor(n, scale):  # vLLM's floor is on the scale, and another value
            nf = n.float()
            s = (nf.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
            return (nf / s).clamp(-448.0, 448.0).to(FP8), s

        def groups_of_64(n, scale):
            nf = n.float().reshape(*n.shape[:-1], n.shape[-1] // 64, 64)
            s = nf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
            return (nf / s).clamp(-448.0, 448.0).to(FP8).reshape(n.shape), s

        def dynamic_per_tensor(n, scale):  # its scale comes from the norm output itself
            nf = n.float()
            s = nf.abs().amax().clamp(min=1e-10) / 448.0
            return (nf / s).clamp(-448.0, 448.0).to(FP8), s

        for quantize in (reciprocal, other_floor, groups_of_64, dynamic_per_tensor):
            with self.subTest(quantize=quantize.__name__):

                def model(x, residual, weight, scale):
                    h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
                    n = vllm_rms_norm(h, weight, 1e-6)
                    return (n, h, *as_tuple(quantize(n, scale)))

                self.check_left_alone(model, self.inputs())

    def test_a_functional_norm_then_quantized_stays_unfused(self):
        # Inductor's joint-graph pass drops the bf16 rounding of a norm computed in fp32 when its
        # output is upcast again (pointless_convert): the graph's norm ends in fp32, not in the
        # form the first stage matches. The site runs unfused and correct.
        def model(x, residual, weight, scale):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            n = torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, 1e-6)
            return (h, *passes.quant_fp8_per_token(n))

        self.check_left_alone(model, self.inputs(), norm_fused=0)


class PassesMoe(_OneRankPasses):
    """The MoE combine before the all-reduce, folded into allreduce_moe_finalize_add_rmsnorm."""

    FUSED_MOE = "tpfuse.allreduce_moe_finalize_add_rmsnorm.default"

    def moe_inputs(self, tokens=6, k=8, hidden=256, weights_dtype=torch.float32):
        generator = torch.Generator().manual_seed(tokens * k + hidden)
        rows = torch.randn(tokens, k, hidden, generator=generator).to(torch.bfloat16)
        weights = torch.rand(tokens, k, generator=generator).to(weights_dtype)
        residual = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(torch.bfloat16)
        return [a.to(self.device) for a in (rows, weights, residual, weight)]

    def check_moe_fused(self, sites=1):
        self.assertEqual(self.fusion.stats["allreduce_moe_finalize_add_rmsnorm"], sites)
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 0)
        before, after = self.ops("before"), self.ops("after")
        self.assertEqual(before.count(ALL_REDUCE), sites)
        self.assertIn("aten.sum.dim_IntList", before)
        self.assertEqual(after.count(ALL_REDUCE), 0, after)
        self.assertEqual(after.count(self.FUSED_MOE), sites, after)
        self.assertEqual(after.count(FUSED), 0, after)
        self.assertNotIn("aten.sum.dim_IntList", after)

    def test_every_combine_form_and_norm_form(self):
        combines = {
            # The end-to-end model's form (bench/e2e/model.py).
            "upcast": (lambda rows, w: (rows.float() * w.unsqueeze(-1)).sum(1).to(rows.dtype),
                       torch.float32),
            "promoted": (lambda rows, w: (rows * w[..., None]).sum(1).to(rows.dtype),
                         torch.float32),
            "in_dtype": (lambda rows, w: (rows * w[..., None]).sum(1), torch.bfloat16),
        }
        norms = {
            "weight_first": lambda h, w: base.hand_written_rms_norm(h, w, 1e-6, True),
            "weight_last": lambda h, w: base.hand_written_rms_norm(h, w, 1e-6, False),
            "functional": lambda h, w: torch.nn.functional.rms_norm(h, (h.shape[-1],), w, 1e-6),
        }
        for combine_name, (combine, weights_dtype) in combines.items():
            for norm_name, norm in norms.items():
                for residual_first in (False, True):
                    with self.subTest(combine=combine_name, norm=norm_name, first=residual_first):

                        def model(rows, weights, residual, weight):
                            reduced = funcol.all_reduce(combine(rows, weights), "sum",
                                                        dist.group.WORLD)
                            h = residual + reduced if residual_first else reduced + residual
                            return norm(h, weight), h

                        args = self.moe_inputs(weights_dtype=weights_dtype)
                        got, expected = self.compile_and_run(model, args)
                        self.check_moe_fused()
                        # The op's bits: the plain fused op on torch's fp32 combine.
                        rows, weights, residual, weight = args
                        combined = (rows.float() * weights.float().unsqueeze(-1))
                        acc = combined[:, 0]
                        for j in range(1, combined.shape[1]):
                            acc = acc + combined[:, j]
                        want = tpfuse.allreduce_add_rmsnorm(self.team, acc.to(rows.dtype),
                                                            residual, weight, 1e-6)
                        self.assertTrue(torch.equal(got[0], want[0]))
                        self.assertTrue(torch.equal(got[1], want[1]))
                        # Close to the unfused model (which may sum k in another order, and in
                        # bf16 for the in-dtype form).
                        tolerance = 6e-2 if combine_name == "in_dtype" else 2e-2
                        for g, e in zip(got, expected):
                            torch.testing.assert_close(g.float(), e.float(), atol=tolerance,
                                                       rtol=tolerance)

    def test_combines_the_op_cannot_serve_are_left_to_the_plain_pattern(self):
        def model(rows, weights, residual, weight):
            # 17 experts: more than the op takes; the all-reduce + add + norm is still fused.
            partial = (rows.float() * weights.unsqueeze(-1)).sum(1).to(rows.dtype)
            h = funcol.all_reduce(partial, "sum", dist.group.WORLD) + residual
            return base.hand_written_rms_norm(h, weight, 1e-6), h

        got, expected = self.compile_and_run(model, self.moe_inputs(k=17))
        self.assertEqual(self.fusion.stats["allreduce_moe_finalize_add_rmsnorm"], 0)
        self.assertEqual(self.fusion.stats["allreduce_add_rmsnorm"], 1)
        self.assertEqual(self.ops("after").count(FUSED), 1)
        base.Passes.check_close(self, got, expected)

    def test_a_dynamic_token_count_keeps_the_combine_fused(self):
        # Automatic dynamic shapes: a static graph for the first count, then one for any count.
        def model(rows, weights, residual, weight):
            partial = (rows.float() * weights.unsqueeze(-1)).sum(1).to(rows.dtype)
            h = funcol.all_reduce(partial, "sum", dist.group.WORLD) + residual
            return vllm_rms_norm(h, weight, 1e-6), h

        torch._dynamo.reset()
        self.fusion.graphs.clear()
        compiled = torch.compile(model, fullgraph=True)
        for tokens in (5, 9, 13):
            args = self.moe_inputs(tokens=tokens, hidden=384)
            base.Passes.check_close(self, compiled(*args), model(*args))
        self.assertEqual([[c["op"] for c in g["tpfuse_calls"]] for g in self.fusion.graphs],
                         [[self.FUSED_MOE]] * 2)

    def test_the_norm_of_a_moe_site_quantized_takes_the_fp8_form_too(self):
        # With the router reading the bf16 norm (kept), and with only the FP8 GEMM reading it
        # (keep_norm=False: no bf16 norm written).
        for mode, (quantize, stat, quant) in MODES.items():
            for router in (True, False):
                with self.subTest(mode=mode, router=router):

                    def model(rows, weights, residual, weight, scale):
                        partial = (rows.float() * weights.unsqueeze(-1)).sum(1).to(rows.dtype)
                        h = funcol.all_reduce(partial, "sum", dist.group.WORLD) + residual
                        n = vllm_rms_norm(h, weight, 1e-6)
                        return ((n,) if router else ()) + (h, *as_tuple(quantize(n, scale)))

                    args = self.moe_inputs(hidden=384) + [torch.tensor([0.02]).to(self.device)]
                    got, expected = self.compile_and_run(model, args)
                    self.assertEqual(self.fusion.stats["allreduce_moe_finalize_add_rmsnorm"], 1)
                    self.assertEqual(self.fusion.stats[stat], 1)
                    after = self.ops("after")
                    self.assertEqual(after.count(ALL_REDUCE), 0, after)
                    self.assertEqual(after.count(self.FUSED_MOE), 0, after)
                    for op in QUANT_OPS:
                        self.assertNotIn(op, after)
                    calls = [c for g in self.fusion.graphs for c in g["tpfuse_calls"]]
                    self.assertEqual([(c["op"], c["keep_norm"]) for c in calls],
                                     [("tpfuse.allreduce_moe_finalize_add_rmsnorm_fp8.default",
                                       router)])
                    # The op called keeping the norm gives the same residual and FP8 bits, and
                    # its FP8 output is the quantization of its own norm.
                    rows, weights, residual, weight, scale = args
                    kept = tpfuse.allreduce_moe_finalize_add_rmsnorm(
                        self.team, rows, weights, residual, weight, 1e-6, quant=quant,
                        scale=scale if mode == "static" else None)
                    if router:
                        self.assertTrue(torch.equal(got[0], kept[0]))  # the router's norm
                    got = got[1:] if router else got
                    expected = expected[1:] if router else expected
                    self.assertTrue(torch.equal(got[0], kept[1]))
                    self.assertTrue(torch.equal(got[1].view(torch.uint8),
                                                kept[2].view(torch.uint8)))
                    s, es = (got[2], expected[2]) if mode != "static" else (None, None)
                    self.check_quantized(mode, kept[0], got[1], s, expected[1], es, scale)

@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class PassesMoeOnCuda(PassesMoe):
    device = "cuda"
    make_team = base.PassesOnCuda.make_team


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class PassesFp8OnCuda(PassesFp8):
    """Every test above on CUDA tensors: a one-rank CUDA team over the group's NCCL side."""

    device = "cuda"
    make_team = base.PassesOnCuda.make_team


class QuantConstants(unittest.TestCase):
    """The FP8 constants the passes' patterns are written with (tpfuse.ops.QUANT_GROUP_SIZE and
    QUANT_MIN_AMAX) are the library's kQuantGroupSize and kQuantMinAmax, read back through the op:
    a per-group call's scales have a column per QUANT_GROUP_SIZE elements (and a hidden that is
    no multiple of it is refused), and an all-zero row's scale is QUANT_MIN_AMAX / 448."""

    def test_constants_are_the_librarys(self):
        group, floor = tpfuse.ops.QUANT_GROUP_SIZE, tpfuse.ops.QUANT_MIN_AMAX
        self.assertIs(passes.QUANT_GROUP_SIZE, group)
        self.assertIs(passes.QUANT_MIN_AMAX, floor)
        (team,) = tpfuse.cpu_team(1)
        hidden = 3 * group
        zeros = torch.zeros(2, hidden, dtype=torch.bfloat16)
        weight = torch.ones(hidden, dtype=torch.bfloat16)
        _, _, q, scales = tpfuse.allreduce_add_rmsnorm_fp8(
            team, zeros, zeros.clone(), weight, 1e-6, tpfuse.Quant.PER_TOKEN_GROUP_128)
        self.assertEqual(tuple(scales.shape), (2, hidden // group))
        expected = torch.tensor(floor, dtype=torch.float32) / 448.0
        self.assertTrue(torch.equal(scales, expected.expand(2, hidden // group)), scales)
        self.assertTrue(torch.equal(q.float(), torch.zeros(2, hidden)))
        _, _, _, scales = tpfuse.allreduce_add_rmsnorm_fp8(
            team, zeros, zeros.clone(), weight, 1e-6, tpfuse.Quant.PER_TOKEN)
        self.assertTrue(torch.equal(scales, expected.expand(2)), scales)
        odd = torch.zeros(2, group + 8, dtype=torch.bfloat16)
        with self.assertRaisesRegex(RuntimeError, f"multiple of {group}"):
            tpfuse.allreduce_add_rmsnorm_fp8(
                team, odd, odd.clone(), torch.ones(group + 8, dtype=torch.bfloat16), 1e-6,
                tpfuse.Quant.PER_TOKEN_GROUP_128)


if __name__ == "__main__":
    unittest.main()
