"""The torch ops on the CPU backend (ranks are threads): numerics against float64, identical bits
on every rank, each algorithm, bad arguments named, the Meta kernels under opcheck and
torch.compile. Run: python3 -m unittest discover -s tests/python (ctest does, when torch is
importable)."""

import subprocess
import sys
import threading
import unittest

import torch

import tpfuse


def on_every_rank(teams, call):
    """call(rank, team) on a thread per rank; returns the results in rank order."""
    results = [None] * len(teams)
    errors = []

    def run(rank):
        try:
            results[rank] = call(rank, teams[rank])
        except Exception as error:  # noqa: BLE001 -- re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(teams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def reference_add_rmsnorm(inputs, residual, weight, eps, one_plus=False):
    total = sum(x.double() for x in inputs)
    if residual is not None:
        total = total + residual.double()
    rounded = total.to(inputs[0].dtype).double()
    scale = weight.double() + 1.0 if one_plus else weight.double()
    norm = rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + eps) * scale
    return norm, total


TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


class AddRmsNorm(unittest.TestCase):
    def test_every_algorithm_matches_float64_and_every_rank_agrees(self):
        generator = torch.Generator().manual_seed(1)
        for world in (2, 4):
            teams = tpfuse.cpu_team(world)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for algorithm in ("auto", "oneshot", "twoshot", "nccl"):
                    for with_residual in (True, False):
                        tokens, hidden = 5, 136
                        inputs = [
                            torch.randn(tokens, hidden, generator=generator).to(dtype)
                            for _ in range(world)
                        ]
                        residual = (
                            torch.randn(tokens, hidden, generator=generator).to(dtype)
                            if with_residual
                            else None
                        )
                        weight = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(dtype)
                        out = on_every_rank(
                            teams,
                            lambda r, t: tpfuse.allreduce_add_rmsnorm(
                                t, inputs[r], residual, weight, 1e-6, algorithm
                            ),
                        )
                        norm_ref, sum_ref = reference_add_rmsnorm(inputs, residual, weight, 1e-6)
                        where = f"world {world} {dtype} {algorithm} residual={with_residual}"
                        tolerance = TOLERANCE[dtype] * (2 if algorithm == "nccl" else 1)
                        for rank in range(world):
                            norm, residual_out = out[rank]
                            torch.testing.assert_close(
                                norm.double(), norm_ref, atol=tolerance, rtol=tolerance, msg=where
                            )
                            torch.testing.assert_close(
                                residual_out.double(), sum_ref, atol=tolerance * 4,
                                rtol=tolerance, msg=where,
                            )
                            self.assertTrue(torch.equal(norm, out[0][0]), where)
                            self.assertTrue(torch.equal(residual_out, out[0][1]), where)
            for team in teams:
                team.close()

    def test_in_place_form_gives_the_functional_bits(self):
        teams = tpfuse.cpu_team(2)
        generator = torch.Generator().manual_seed(4)
        inputs = [torch.randn(3, 128, generator=generator).to(torch.bfloat16) for _ in range(2)]
        residual = torch.randn(3, 128, generator=generator).to(torch.bfloat16)
        weight = torch.ones(128, dtype=torch.bfloat16)
        functional = on_every_rank(
            teams, lambda r, t: tpfuse.allreduce_add_rmsnorm(t, inputs[r], residual, weight, 1e-6)
        )
        buffers = [(inputs[r].clone(), residual.clone()) for r in range(2)]
        on_every_rank(
            teams,
            lambda r, t: tpfuse.allreduce_add_rmsnorm_(t, buffers[r][0], buffers[r][1], weight, 1e-6),
        )
        for rank in range(2):
            self.assertTrue(torch.equal(buffers[rank][0], functional[rank][0]))
            self.assertTrue(torch.equal(buffers[rank][1], functional[rank][1]))
        for team in teams:
            team.close()

    def test_one_plus_gamma_weight(self):
        """norm_weight=ONE_PLUS_GAMMA: against float64, in every algorithm and both op forms, and
        bit for bit the plain weight given 1 + gamma where that is exact (steps of 1/8)."""
        generator = torch.Generator().manual_seed(5)
        teams = tpfuse.cpu_team(2)
        one_plus = tpfuse.NormWeight.ONE_PLUS_GAMMA
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            inputs = [torch.randn(5, 136, generator=generator).to(dtype) for _ in range(2)]
            residual = torch.randn(5, 136, generator=generator).to(dtype)
            weight = (torch.randint(-16, 17, (136,), generator=generator) / 8).to(dtype)
            norm_ref, _ = reference_add_rmsnorm(inputs, residual, weight, 1e-6, one_plus=True)
            plain = on_every_rank(
                teams,
                lambda r, t: tpfuse.allreduce_add_rmsnorm(t, inputs[r], residual, weight + 1, 1e-6),
            )
            for algorithm in ("oneshot", "twoshot", "nccl"):
                out = on_every_rank(
                    teams,
                    lambda r, t: tpfuse.allreduce_add_rmsnorm(
                        t, inputs[r], residual, weight, 1e-6, algorithm, one_plus
                    ),
                )
                where = f"{dtype} {algorithm}"
                tolerance = TOLERANCE[dtype] * (2 if algorithm == "nccl" else 1)
                for rank in range(2):
                    torch.testing.assert_close(
                        out[rank][0].double(), norm_ref, atol=tolerance, rtol=tolerance, msg=where
                    )
                    self.assertTrue(torch.equal(out[rank][0], out[0][0]), where)
                    if algorithm != "nccl":
                        self.assertTrue(torch.equal(out[rank][0], plain[rank][0]), where)
            buffers = [(inputs[r].clone(), residual.clone()) for r in range(2)]
            on_every_rank(
                teams,
                lambda r, t: tpfuse.allreduce_add_rmsnorm_(
                    t, buffers[r][0], buffers[r][1], weight, 1e-6, "auto", one_plus
                ),
            )
            for rank in range(2):
                self.assertTrue(torch.equal(buffers[rank][0], plain[rank][0]))
        (solo,) = tpfuse.cpu_team(1)
        with self.assertRaisesRegex(RuntimeError, "norm_weight"):
            tpfuse.allreduce_add_rmsnorm(solo, inputs[0], None, weight, 1e-6, "auto", 2)
        for team in teams + [solo]:
            team.close()

    def test_allreduce_sums_in_rank_order(self):
        teams = tpfuse.cpu_team(3)
        inputs = [torch.full((4, 16), float(r + 1), dtype=torch.float32) for r in range(3)]
        out = on_every_rank(teams, lambda r, t: tpfuse.allreduce(t, inputs[r]))
        for tensor in out:
            self.assertTrue(torch.equal(tensor, torch.full((4, 16), 6.0)))
        for team in teams:
            team.close()

    def test_bad_arguments_are_named(self):
        (team,) = tpfuse.cpu_team(1)
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        weight = torch.ones(64, dtype=torch.bfloat16)
        cases = [
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x.double(), None, weight, 1e-6), "input"),
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, None, weight[:32], 1e-6),
             r"weight must be \[hidden = 64\]"),
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, x.float(), weight, 1e-6), "residual"),
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x.t(), None, weight, 1e-6), "contiguous"),
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, None, weight, -1.0), "eps"),
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, None, weight, 1e-6, 9), "algorithm"),
            (lambda: tpfuse.allreduce_add_rmsnorm(12345, x, None, weight, 1e-6), "team 12345"),
        ]
        for call, name in cases:
            with self.assertRaisesRegex(RuntimeError, name):
                call()
        # Each of these was accepted, or named the wrong thing.
        same = x.clone()
        with self.assertRaisesRegex(RuntimeError, "input and residual are the same tensor"):
            tpfuse.allreduce_add_rmsnorm_(team, same, same, weight, 1e-6)
        with self.assertRaisesRegex(TypeError, "residual must be a tensor"):
            tpfuse.allreduce_add_rmsnorm_(team, x.clone(), None, weight, 1e-6)
        # The raw op takes None where its schema has a tensor: named, not "got UNKNOWN_SCALAR".
        with self.assertRaisesRegex(TypeError,
                                    "allreduce_add_rmsnorm_: residual must be a tensor, got None"):
            torch.ops.tpfuse.allreduce_add_rmsnorm_(team.handle, x.clone(), None, weight, 1e-6)
        # The in-place ops name their own arguments, not the library's norm_out / gamma.
        storage = torch.zeros(3 * 2 * 64, dtype=torch.bfloat16)
        rows, other, tail = storage[:128].view(2, 64), storage[128:256].view(2, 64), storage[256:]
        in_place = [
            (lambda: torch.ops.tpfuse.allreduce_add_rmsnorm_(team.handle, rows, other,
                                                              rows[0], 1e-6),
             "allreduce_add_rmsnorm_: input overlaps weight"),
            (lambda: torch.ops.tpfuse.allreduce_add_rmsnorm_(team.handle, rows, other,
                                                              other[1], 1e-6),
             "allreduce_add_rmsnorm_: residual overlaps weight"),
            (lambda: torch.ops.tpfuse.allreduce_add_rmsnorm_(team.handle, rows,
                                                              storage[64:192].view(2, 64),
                                                              tail[:64], 1e-6),
             "allreduce_add_rmsnorm_: input and residual overlap"),
            (lambda: torch.ops.tpfuse.allreduce_add_rmsnorm_fp8_(team.handle, rows, other,
                                                                  rows[1], 1e-6, 2),
             "allreduce_add_rmsnorm_fp8_: input overlaps weight"),
        ]
        for call, message in in_place:
            with self.assertRaisesRegex(RuntimeError, message):
                call()
        self.assertTrue(torch.equal(storage, torch.zeros_like(storage)), "nothing was written")
        with self.assertRaisesRegex(RuntimeError, "weight is on cpu but another argument is a meta"):
            tpfuse.allreduce_add_rmsnorm(team, x.to("meta"), None, weight, 1e-6)
        with self.assertRaisesRegex(RuntimeError, "input is on cpu but another argument is a meta"):
            tpfuse.allreduce_add_rmsnorm(team, x, None, weight.to("meta"), 1e-6)
        empty = torch.empty(0, 64, dtype=torch.bfloat16)
        norm, residual_out = tpfuse.allreduce_add_rmsnorm(team, empty, empty, weight, 1e-6)
        self.assertEqual(tuple(norm.shape), (0, 64))
        with self.assertRaises(RuntimeError) as raised:
            tpfuse.allreduce_add_rmsnorm(team, x, None, weight[:32], 1e-6)
        self.assertNotRegex(str(raised.exception), r"\(/", "no absolute build path in messages")
        handle = team.handle
        team.close()
        with self.assertRaisesRegex(RuntimeError, "not a live team"):
            tpfuse.allreduce_add_rmsnorm(handle, x, None, weight, 1e-6)


def torch_fp8(norm, quant, scale=None):
    """The FP8 output as torch code writes it, from the norm as stored: (quant_out, scales)."""
    x = norm.float()
    if quant == tpfuse.Quant.STATIC:
        scales = torch.empty(0)
        q = x / scale
    elif quant == tpfuse.Quant.PER_TOKEN:
        scales = x.abs().amax(-1).clamp(min=1e-10) / 448.0
        q = x / scales[:, None]
    else:
        groups = x.reshape(x.shape[0], -1, 128)
        scales = groups.abs().amax(-1).clamp(min=1e-10) / 448.0
        if quant == tpfuse.Quant.PER_TOKEN_GROUP_128_UE8M0:
            # Rounded up to a power of two on the bits, as DeepGEMM's reference casts do.
            bits = scales.view(torch.int32)
            exponent = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
            scales = (exponent << 23).view(torch.float32)
        q = (groups / scales[..., None]).reshape(x.shape)
    return q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scales


class Fp8Outputs(unittest.TestCase):
    """The norm's FP8 output from torch: the same norm and residual bits as the plain op, and
    quant_out and scales equal, bit for bit, to torch code quantizing that norm."""

    def test_every_mode_and_algorithm_equals_torch_quantizing_the_norm(self):
        generator = torch.Generator().manual_seed(3)
        teams = tpfuse.cpu_team(2)
        scale = torch.tensor([0.005])
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for quant in tpfuse.Quant:
                for algorithm in ("auto", "oneshot", "twoshot", "nccl"):
                    tokens, hidden = 7, 384  # 3 groups of 128
                    inputs = [torch.randn(tokens, hidden, generator=generator).to(dtype)
                              for _ in range(2)]
                    residual = torch.randn(tokens, hidden, generator=generator).to(dtype)
                    weight = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(dtype)
                    given = scale if quant == tpfuse.Quant.STATIC else None
                    out = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8(
                        t, inputs[r], residual, weight, 1e-6, quant.name.lower(), given,
                        algorithm))
                    plain = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm(
                        t, inputs[r], residual, weight, 1e-6, algorithm))
                    where = f"{dtype} {quant.name} {algorithm}"
                    for rank in range(2):
                        norm, residual_out, quant_out, scales = out[rank]
                        self.assertTrue(torch.equal(norm, plain[rank][0]), where)
                        self.assertTrue(torch.equal(residual_out, plain[rank][1]), where)
                        self.assertEqual(quant_out.dtype, torch.float8_e4m3fn)
                        expected_q, expected_scales = torch_fp8(norm, quant, scale)
                        self.assertTrue(torch.equal(quant_out.view(torch.uint8),
                                                    expected_q.view(torch.uint8)), where)
                        self.assertTrue(torch.equal(scales, expected_scales), where)
                        self.assertTrue(torch.equal(quant_out.view(torch.uint8),
                                                    out[0][2].view(torch.uint8)), where)
        # In place: input <- norm, residual <- sum; the same FP8 bytes.
        x = [torch.randn(3, 256, generator=generator).to(torch.bfloat16) for _ in range(2)]
        res = [torch.randn(3, 256, generator=generator).to(torch.bfloat16)] * 2
        weight = torch.ones(256, dtype=torch.bfloat16)
        functional = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8(
            t, x[r], res[r], weight, 1e-6, "per_token_group_128"))
        copies = [(x[r].clone(), res[r].clone()) for r in range(2)]
        in_place = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8_(
            t, copies[r][0], copies[r][1], weight, 1e-6, tpfuse.Quant.PER_TOKEN_GROUP_128))
        # Column-major group scales: the same values, token-major in memory.
        columns = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8(
            t, x[r], res[r], weight, 1e-6, "per_token_group_128", column_major_scales=True))
        for rank in range(2):
            scales = columns[rank][3]
            self.assertEqual(tuple(scales.shape), (3, 2))
            self.assertEqual(scales.stride(), (1, 3))
            self.assertTrue(torch.equal(scales, functional[rank][3]))
            self.assertTrue(torch.equal(columns[rank][2].view(torch.uint8),
                                        functional[rank][2].view(torch.uint8)))
        for rank in range(2):
            self.assertTrue(torch.equal(copies[rank][0], functional[rank][0]))
            self.assertTrue(torch.equal(copies[rank][1], functional[rank][1]))
            self.assertTrue(torch.equal(in_place[rank][0].view(torch.uint8),
                                        functional[rank][2].view(torch.uint8)))
            self.assertTrue(torch.equal(in_place[rank][1], functional[rank][3]))
        for team in teams:
            team.close()

    def test_without_the_bf16_norm_every_other_output_keeps_its_bits(self):
        # keep_norm=False: no bf16 norm written (norm_out is [0, hidden]; the in-place form leaves
        # input as it was), and residual_out, quant_out and scales are the call's that keeps it.
        generator = torch.Generator().manual_seed(11)
        teams = tpfuse.cpu_team(2)
        rows = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
        for quant in tpfuse.Quant:
            for algorithm in ("oneshot", "twoshot", "nccl"):
                where = f"{quant.name} {algorithm}"
                x = [torch.randn(5, 384, generator=generator).to(torch.bfloat16) for _ in range(2)]
                residual = torch.randn(5, 384, generator=generator).to(torch.bfloat16)
                weight = (1 + 0.2 * torch.randn(384, generator=generator)).to(torch.bfloat16)
                scale = torch.tensor([0.01]) if quant == tpfuse.Quant.STATIC else None
                kept = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8(
                    t, x[r], residual, weight, 1e-6, quant, scale, algorithm))
                bare = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8(
                    t, x[r], residual, weight, 1e-6, quant, scale, algorithm, keep_norm=False))
                copies = [(x[r].clone(), residual.clone()) for r in range(2)]
                in_place = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8_(
                    t, copies[r][0], copies[r][1], weight, 1e-6, quant, scale, algorithm,
                    keep_norm=False))
                for rank in range(2):
                    self.assertEqual(tuple(bare[rank][0].shape), (0, 384), where)
                    for got, want in zip(bare[rank][1:], kept[rank][1:]):
                        self.assertTrue(torch.equal(rows(got), rows(want)), where)
                    self.assertTrue(torch.equal(copies[rank][0], x[rank]), where)  # untouched
                    self.assertTrue(torch.equal(copies[rank][1], kept[rank][1]), where)
                    for got, want in zip(in_place[rank], kept[rank][2:]):
                        self.assertTrue(torch.equal(rows(got), rows(want)), where)
        for team in teams:
            team.close()

    def test_without_the_norm_input_may_hold_the_weight(self):
        # keep_norm=False writes nothing into input, so a weight that is a view of it is read
        # as it is; keeping the norm, that is refused before anything is written.
        (team,) = tpfuse.cpu_team(1)
        generator = torch.Generator().manual_seed(5)
        x = torch.randn(3, 256, generator=generator).to(torch.bfloat16)
        residual = torch.randn(3, 256, generator=generator).to(torch.bfloat16)
        weight = x[1]  # row 1 of input
        want = tpfuse.allreduce_add_rmsnorm_fp8(team, x, residual, weight.clone(), 1e-6,
                                                "per_token", keep_norm=False)
        before = x.clone()
        q, scales = tpfuse.allreduce_add_rmsnorm_fp8_(team, x, residual, weight, 1e-6,
                                                      "per_token", keep_norm=False)
        self.assertTrue(torch.equal(x, before))
        self.assertTrue(torch.equal(residual, want[1]))
        self.assertTrue(torch.equal(q.view(torch.uint8), want[2].view(torch.uint8)))
        self.assertTrue(torch.equal(scales, want[3]))
        with self.assertRaisesRegex(RuntimeError, "input overlaps weight"):
            tpfuse.allreduce_add_rmsnorm_fp8_(team, x, residual, weight, 1e-6, "per_token")
        team.close()

    def test_bad_fp8_arguments_are_named(self):
        (team,) = tpfuse.cpu_team(1)
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        weight = torch.ones(256, dtype=torch.bfloat16)
        cases = [
            (lambda: tpfuse.allreduce_add_rmsnorm_fp8(team, x, x, weight, 1e-6, "static"),
             "quant fp8 static needs the scale"),
            (lambda: tpfuse.allreduce_add_rmsnorm_fp8(team, x, x, weight, 1e-6, "static",
                                                      torch.ones(2)), "scale must be a float32 "
             "tensor of one element"),
            (lambda: tpfuse.allreduce_add_rmsnorm_fp8(team, x, x, weight, 1e-6, "per_token",
                                                      torch.ones(1)),
             "quant_scale is given but quant is fp8 per token"),
            (lambda: tpfuse.allreduce_add_rmsnorm_fp8(team, x[:, :192], x[:, :192],
                                                      weight[:192], 1e-6, 3),
             "hidden must be a multiple of 128"),
            (lambda: tpfuse.allreduce_add_rmsnorm_fp8(team, x[:, :192], x[:, :192],
                                                      weight[:192], 1e-6,
                                                      "per_token_group_128_ue8m0"),
             "hidden must be a multiple of 128"),
            (lambda: torch.ops.tpfuse.allreduce_add_rmsnorm_fp8(team.handle, x, x, weight, 1e-6, 7),
             "quant must be 1 \\(static\\), 2 \\(per_token\\), 3 "
             "\\(per_token_group_128\\) or 4 \\(per_token_group_128_ue8m0\\), got 7"),
        ]
        for call, message in cases:
            with self.assertRaisesRegex(RuntimeError, message):
                call()
        with self.assertRaisesRegex(ValueError, "quant must be one of"):
            tpfuse.allreduce_add_rmsnorm_fp8(team, x, x, weight, 1e-6, "fp8")
        team.close()


class MoeFinalize(unittest.TestCase):
    """The MoE finalize fused in, from torch: the same bits as the plain op given each rank's
    combine computed by torch (fp32 products in expert order, then the shared row, rounded once),
    close to float64, identical on every rank, with and without FP8 output."""

    @staticmethod
    def torch_combine(rows, weights, shared):
        products = rows.float() * weights.float().unsqueeze(-1)
        acc = products[:, 0]
        for j in range(1, rows.shape[1]):
            acc = acc + products[:, j]
        if shared is not None:
            acc = acc + shared.float()
        return acc.to(rows.dtype)

    def test_every_algorithm_equals_the_plain_op_on_torch_s_combine(self):
        generator = torch.Generator().manual_seed(11)
        teams = tpfuse.cpu_team(2)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for topk, with_shared, weights_dtype in ((1, False, torch.float32), (8, True, dtype),
                                                     (3, True, torch.float32)):
                for algorithm in ("auto", "oneshot", "twoshot", "nccl"):
                    tokens, hidden = 5, 256
                    rows = [torch.randn(tokens, topk, hidden, generator=generator).to(dtype)
                            for _ in range(2)]
                    weights = [torch.rand(tokens, topk, generator=generator).to(weights_dtype)
                               for _ in range(2)]
                    shared = [torch.randn(tokens, hidden, generator=generator).to(dtype)
                              if with_shared else None for _ in range(2)]
                    residual = torch.randn(tokens, hidden, generator=generator).to(dtype)
                    weight = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(dtype)
                    combined = [self.torch_combine(rows[r], weights[r], shared[r])
                                for r in range(2)]
                    fused = on_every_rank(teams, lambda r, t: tpfuse.allreduce_moe_finalize_add_rmsnorm(
                        t, rows[r], weights[r], residual, weight, 1e-6, shared[r],
                        algorithm=algorithm))
                    plain = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm(
                        t, combined[r], residual, weight, 1e-6, algorithm))
                    fp8 = on_every_rank(teams, lambda r, t: tpfuse.allreduce_moe_finalize_add_rmsnorm(
                        t, rows[r], weights[r], residual, weight, 1e-6, shared[r],
                        quant="per_token_group_128", algorithm=algorithm))
                    plain_fp8 = on_every_rank(teams, lambda r, t: tpfuse.allreduce_add_rmsnorm_fp8(
                        t, combined[r], residual, weight, 1e-6, "per_token_group_128",
                        algorithm=algorithm))
                    where = f"{dtype} topk={topk} shared={with_shared} {weights_dtype} {algorithm}"
                    expected_norm, _ = reference_add_rmsnorm(combined, residual, weight, 1e-6)
                    for rank in range(2):
                        for got, want in zip(fused[rank], plain[rank]):
                            self.assertTrue(torch.equal(got, want), where)
                        for got, want in zip(fp8[rank], plain_fp8[rank]):
                            self.assertTrue(torch.equal(got.view(torch.uint8) if got.dtype ==
                                                        torch.float8_e4m3fn else got,
                                                        want.view(torch.uint8) if want.dtype ==
                                                        torch.float8_e4m3fn else want), where)
                        self.assertTrue(torch.equal(fused[rank][0], fused[0][0]), where)
                        torch.testing.assert_close(fused[rank][0].double(), expected_norm,
                                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        for team in teams:
            team.close()

    def test_bad_arguments_are_named(self):
        (team,) = tpfuse.cpu_team(1)
        rows = torch.randn(2, 3, 64, dtype=torch.bfloat16)
        weights = torch.rand(2, 3)
        residual = torch.randn(2, 64, dtype=torch.bfloat16)
        weight = torch.ones(64, dtype=torch.bfloat16)
        op = tpfuse.allreduce_moe_finalize_add_rmsnorm
        cases = [
            (lambda: op(team, rows[:, :, :32].contiguous(), weights, residual, weight, 1e-6),
             "expert_rows must be \\[tokens = 2, topk, hidden = 64\\]"),
            (lambda: op(team, rows.float(), weights, residual, weight, 1e-6),
             "expert_rows must have dtype BFloat16"),
            (lambda: op(team, rows, weights.double(), residual, weight, 1e-6),
             "routing_weights must be float32 or BFloat16"),
            (lambda: op(team, rows, weights[:, :2].contiguous(), residual, weight, 1e-6),
             "routing_weights must be \\[tokens, topk\\] = \\[2, 3\\]"),
            (lambda: op(team, rows, weights, residual, weight, 1e-6, residual[:1]),
             "shared_expert must be \\[2, 64\\]"),
            (lambda: op(team, torch.randn(2, 17, 64, dtype=torch.bfloat16), torch.rand(2, 17),
                        residual, weight, 1e-6), "moe_topk must be in \\[1, 16\\], got 17"),
            (lambda: op(team, rows, weights, residual, weight, 1e-6, quant="static"),
             "quant fp8 static needs the scale"),
        ]
        for call, message in cases:
            with self.assertRaisesRegex(RuntimeError, message):
                call()
        with self.assertRaisesRegex(ValueError, "keep_norm=False needs quant"):
            op(team, rows, weights, residual, weight, 1e-6, keep_norm=False)
        team.close()


def run_in_fresh_interpreter(code):
    """`code` run by a new Python process (its stdout and stderr captured): a state this one
    cannot have, such as one thread only or torch.distributed never initialized."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


class RanksThatGoWrong(unittest.TestCase):
    """A rank that rejects its call (in torch's checks, tpfuse's, or Python's) still takes its
    turn: its peers' call ends at once with an error naming it, and the team goes on. Ranks that
    disagree are told the peer and the field. One thread driving two ranks is told at once."""

    def setUp(self):
        self.teams = tpfuse.cpu_team(2, peer_timeout_seconds=5.0)
        self.x = [torch.randn(2, 64).to(torch.bfloat16) for _ in range(2)]
        self.weight = torch.ones(64, dtype=torch.bfloat16)

    def tearDown(self):
        for team in self.teams:
            team.close()

    def both(self, call_rank0):
        """Rank 0 runs call_rank0, rank 1 a good call; returns the two errors (or None)."""
        errors = [None, None]

        def run(rank):
            try:
                if rank == 0:
                    call_rank0()
                else:
                    tpfuse.allreduce_add_rmsnorm(self.teams[1], self.x[1], None, self.weight, 1e-6)
            except (RuntimeError, TypeError, ValueError) as error:
                errors[rank] = error

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return errors

    def expect_team_goes_on(self):
        out = on_every_rank(
            self.teams,
            lambda r, t: tpfuse.allreduce_add_rmsnorm(t, self.x[r], None, self.weight, 1e-6),
        )
        self.assertTrue(torch.equal(out[0][1], out[1][1]))
        torch.testing.assert_close(
            out[0][1].double(), (self.x[0].double() + self.x[1].double()), atol=3e-2, rtol=3e-2
        )

    def test_a_rejected_call_ends_the_peers_call_and_the_team_goes_on(self):
        team, x, weight = self.teams[0], self.x[0], self.weight
        cases = [
            # torch-side checks
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, None, weight[:32], 1e-6),
             "weight must be [hidden = 64], got [32]"),
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x.t(), None, weight, 1e-6), "contiguous"),
            # tpfuse's own checks
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, None, weight, -1.0), "eps"),
            # Python's
            (lambda: tpfuse.allreduce_add_rmsnorm(team, x, None, weight, 1e-6, "fast"), "algorithm"),
            (lambda: tpfuse.allreduce_add_rmsnorm_(team, x.clone(), None, weight, 1e-6),
             "residual must be a tensor"),
            # and a runtime's own reason
            (lambda: tpfuse.reject_call(team), None),
        ]
        for call, name in cases:
            errors = self.both(call)
            if name is None:
                self.assertIsNone(errors[0])
            else:
                self.assertIsNotNone(errors[0], name)
                self.assertIn(name, str(errors[0]))
            self.assertIsInstance(errors[1], RuntimeError, name)
            self.assertIn("rank 0 rejected its part of this call", str(errors[1]))
            self.expect_team_goes_on()

    def test_ranks_that_disagree_are_told_the_peer_and_the_field(self):
        longer = torch.randn(3, 64).to(torch.bfloat16)
        errors = self.both(
            lambda: tpfuse.allreduce_add_rmsnorm(self.teams[0], longer, None, self.weight, 1e-6)
        )
        self.assertIn("rank 1's call disagrees with this rank's, in tokens: 3 here, 2 on rank 1",
                      str(errors[0]))
        self.assertIn("rank 0's call disagrees with this rank's, in tokens: 2 here, 3 on rank 0",
                      str(errors[1]))

    def test_one_thread_for_two_ranks_is_told_at_once(self):
        # In a fresh interpreter, whose only thread is the caller's (this one's test runner may
        # have others): the call would wait for a rank no other thread can call.
        child = (
            "import torch, tpfuse\n"
            "teams = tpfuse.cpu_team(2, peer_timeout_seconds=600.0)\n"
            "x = torch.ones(2, 64, dtype=torch.bfloat16)\n"
            "try:\n"
            "    tpfuse.allreduce_add_rmsnorm(teams[0], x, None, x[0], 1e-6)\n"
            "except RuntimeError as error:\n"
            "    print(error)\n"
        )
        result = run_in_fresh_interpreter(child)
        self.assertIn("each rank needs its own thread", result.stdout, result.stderr)

    def test_from_group_names_what_is_missing(self):
        # In a fresh interpreter: torch.distributed not yet initialized, then a group of a backend
        # that is neither NCCL nor gloo (torch's fake one), both told before anything is made.
        child = (
            "import torch, torch.distributed as dist, tpfuse\n"
            "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
            "try:\n"
            "    tpfuse.Team.from_group()\n"
            "except RuntimeError as error:\n"
            "    print(error)\n"
            "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)\n"
            "try:\n"
            "    tpfuse.Team.from_group()\n"
            "except ValueError as error:\n"
            "    print(error)\n"
            "dist.destroy_process_group()\n"
        )
        result = run_in_fresh_interpreter(child)
        self.assertIn("torch.distributed is not initialized", result.stdout, result.stderr)
        self.assertIn("the group's backend is 'fake'; pass backend='cuda' or backend='cpu'",
                      result.stdout, result.stderr)


class QkRmsNorm(unittest.TestCase):
    def test_matches_float64_across_ranks(self):
        generator = torch.Generator().manual_seed(2)
        world, heads, kv_heads, head_dim, tokens = 2, 4, 1, 64, 3
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        teams = tpfuse.cpu_team(world)
        qkv = [
            torch.randn(tokens, q_size + 2 * kv_size, generator=generator).to(torch.bfloat16)
            for _ in range(world)
        ]
        q_weight = [torch.ones(q_size, dtype=torch.bfloat16) for _ in range(world)]
        k_weight = [torch.ones(kv_size, dtype=torch.bfloat16) for _ in range(world)]
        for algorithm in ("auto", "oneshot", "nccl"):
            out = on_every_rank(
                teams,
                lambda r, t: tpfuse.allreduce_qk_rmsnorm(
                    t, qkv[r], q_weight[r], k_weight[r], q_size, kv_size, q_size * world,
                    kv_size * world, 1e-6, algorithm=algorithm,
                ),
            )
            q_all = torch.cat([x[:, :q_size].double() for x in qkv], dim=1)
            k_all = torch.cat([x[:, q_size : q_size + kv_size].double() for x in qkv], dim=1)
            q_rstd = torch.rsqrt(q_all.pow(2).mean(-1, keepdim=True) + 1e-6)
            k_rstd = torch.rsqrt(k_all.pow(2).mean(-1, keepdim=True) + 1e-6)
            for rank in range(world):
                q, k = out[rank]
                q_ref = qkv[rank][:, :q_size].double() * q_rstd
                k_ref = qkv[rank][:, q_size : q_size + kv_size].double() * k_rstd
                torch.testing.assert_close(q.double(), q_ref, atol=3e-2, rtol=3e-2)
                torch.testing.assert_close(k.double(), k_ref, atol=3e-2, rtol=3e-2)
        for team in teams:
            team.close()


class QkArguments(unittest.TestCase):
    def test_bad_arguments_are_named(self):
        (team,) = tpfuse.cpu_team(1)
        q_size, kv_size = 128, 64
        qkv = torch.randn(3, q_size + 2 * kv_size).to(torch.bfloat16)
        q_weight = torch.ones(q_size, dtype=torch.bfloat16)
        k_weight = torch.ones(kv_size, dtype=torch.bfloat16)
        positions = torch.zeros(3, dtype=torch.long)
        cache = torch.zeros(8, 32)

        def call(**changes):
            args = dict(q_weight=q_weight, k_weight=k_weight, positions=positions,
                        cos_sin_cache=cache)
            args.update(changes)
            return tpfuse.allreduce_qk_rmsnorm(
                team, qkv, args["q_weight"], args["k_weight"], q_size, kv_size, q_size, kv_size,
                1e-6, positions=args["positions"], cos_sin_cache=args["cos_sin_cache"],
                head_dim=64, rotary_dim=32, rope_style=tpfuse.RopeStyle.NEOX,
            )

        call()  # the good call runs
        cases = [
            (dict(q_weight=q_weight[:64]), r"q_weight must be \[q_size = 128\]"),
            (dict(k_weight=torch.ones(2 * kv_size, dtype=torch.bfloat16)),
             r"k_weight must be \[kv_size = 64\]"),
            (dict(cos_sin_cache=cache.to(torch.bfloat16)), "cos_sin_cache must be float32"),
            (dict(q_weight=q_weight.to("meta")), "qkv is on cpu but another argument is a meta"),
        ]
        for changes, message in cases:
            with self.assertRaisesRegex(RuntimeError, message):
                call(**changes)
        team.close()


class QkRope(unittest.TestCase):
    def test_neox_partial_rope_matches_float64(self):
        generator = torch.Generator().manual_seed(5)
        world, heads, kv_heads, head_dim, rotary_dim, tokens = 2, 2, 1, 64, 32, 4
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        teams = tpfuse.cpu_team(world)
        qkv = [
            torch.randn(tokens, q_size + 2 * kv_size, generator=generator).to(torch.bfloat16)
            for _ in range(world)
        ]
        ones_q = torch.ones(q_size, dtype=torch.bfloat16)
        ones_k = torch.ones(kv_size, dtype=torch.bfloat16)
        max_position = 16
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * (
            10000.0 ** (-torch.arange(rotary_dim // 2, dtype=torch.float64) * 2 / rotary_dim)
        )
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
        positions = torch.tensor([3, 0, 15, 7], dtype=torch.int64)
        out = on_every_rank(
            teams,
            lambda r, t: tpfuse.allreduce_qk_rmsnorm(
                t, qkv[r], ones_q, ones_k, q_size, kv_size, q_size * world, kv_size * world,
                1e-6, positions=positions, cos_sin_cache=cos_sin, head_dim=head_dim,
                rotary_dim=rotary_dim, rope_style=tpfuse.RopeStyle.NEOX,
            ),
        )
        q_all = torch.cat([x[:, :q_size].double() for x in qkv], dim=1)
        q_rstd = torch.rsqrt(q_all.pow(2).mean(-1, keepdim=True) + 1e-6)
        cos = cos_sin.double()[positions, : rotary_dim // 2][:, None, :]
        sin = cos_sin.double()[positions, rotary_dim // 2 :][:, None, :]
        for rank in range(world):
            q = (qkv[rank][:, :q_size].double() * q_rstd).view(tokens, heads, head_dim)
            x1, x2 = q[..., : rotary_dim // 2], q[..., rotary_dim // 2 : rotary_dim]
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, q[..., rotary_dim:]], -1)
            torch.testing.assert_close(
                out[rank][0].double(), rotated.reshape(tokens, q_size), atol=3e-2, rtol=3e-2
            )
        (alone,) = tpfuse.cpu_team(1)
        with self.assertRaisesRegex(RuntimeError, "positions is null but rope is set"):
            tpfuse.allreduce_qk_rmsnorm(
                alone, qkv[0], ones_q, ones_k, q_size, kv_size, q_size, kv_size, 1e-6,
                rope_style=tpfuse.RopeStyle.NEOX, head_dim=head_dim, rotary_dim=rotary_dim,
            )
        with self.assertRaisesRegex(RuntimeError, r"cos_sin_cache must be .* \[max_position, 30\]"):
            tpfuse.allreduce_qk_rmsnorm(
                alone, qkv[0], ones_q, ones_k, q_size, kv_size, q_size, kv_size, 1e-6,
                positions=positions, cos_sin_cache=cos_sin, head_dim=head_dim, rotary_dim=30,
                rope_style=tpfuse.RopeStyle.NEOX,
            )
        with self.assertRaisesRegex(RuntimeError, "rotary_dim must be even"):
            tpfuse.allreduce_qk_rmsnorm(
                alone, qkv[0], ones_q, ones_k, q_size, kv_size, q_size, kv_size, 1e-6,
                positions=positions, cos_sin_cache=torch.zeros(16, 33), head_dim=head_dim,
                rotary_dim=33, rope_style=tpfuse.RopeStyle.NEOX,
            )
        for team in teams + [alone]:
            team.close()


class EnumArguments(unittest.TestCase):
    """The raw ops' enum arguments take exactly the library's enumerators: below the first, past
    the last, and a valid value plus 2^32 (which a cast to the 32-bit enum would wrap onto it)
    are refused, each naming the argument."""

    def test_values_outside_each_enum_are_refused(self):
        (team,) = tpfuse.cpu_team(1)
        x = torch.randn(2, 128, dtype=torch.bfloat16)
        weight = torch.ones(128, dtype=torch.bfloat16)
        q_size, kv_size = 128, 64
        qkv = torch.randn(2, q_size + 2 * kv_size, dtype=torch.bfloat16)
        ops = torch.ops.tpfuse
        calls = {
            "algorithm": ((-1, 4, 2**32 + 1),
                          lambda v: ops.allreduce_add_rmsnorm(team.handle, x, None, weight, 1e-6,
                                                              v)),
            "norm_weight": ((-1, 2, 2**32),
                            lambda v: ops.allreduce_add_rmsnorm(team.handle, x, None, weight, 1e-6,
                                                                0, v)),
            "quant": ((-1, 0, 5, 2**32 + 2),
                      lambda v: ops.allreduce_add_rmsnorm_fp8(team.handle, x, x, weight, 1e-6, v)),
            "rope_style": ((-1, 3, 2**32 + 1),
                           lambda v: ops.allreduce_qk_rmsnorm(
                               team.handle, qkv, torch.ones(q_size, dtype=torch.bfloat16),
                               torch.ones(kv_size, dtype=torch.bfloat16), q_size, kv_size, q_size,
                               kv_size, 1, 1e-6, None, None, 64, 64, v)),
        }
        for name, (values, call) in calls.items():
            for value in values:
                with self.subTest(name=name, value=value):
                    with self.assertRaisesRegex(RuntimeError, f"{name} must be .*, got {value}"):
                        call(value)
        team.close()


class Declarations(unittest.TestCase):
    """Each fused op is declared once, in C++ (src/torch/ops.cc): its schema is what graphs and
    users call (the passes match these), and the Python wrappers and enums are made from it."""

    SCHEMAS = [
        "tpfuse::allreduce_add_rmsnorm(int team, Tensor input, Tensor? residual, Tensor weight, "
        "float eps, int algorithm=0, int norm_weight=0) -> (Tensor norm_out, Tensor residual_out)",
        "tpfuse::allreduce_add_rmsnorm_(int team, Tensor(a!) input, Tensor(b!) residual, "
        "Tensor weight, float eps, int algorithm=0, int norm_weight=0) -> ()",
        "tpfuse::allreduce_add_rmsnorm_fp8(int team, Tensor input, Tensor? residual, "
        "Tensor weight, float eps, int quant, Tensor? scale=None, bool column_major_scales=False, "
        "int algorithm=0, int norm_weight=0, bool keep_norm=True) -> (Tensor norm_out, "
        "Tensor residual_out, Tensor quant_out, Tensor scales)",
        "tpfuse::allreduce_add_rmsnorm_fp8_(int team, Tensor(a!) input, Tensor(b!) residual, "
        "Tensor weight, float eps, int quant, Tensor? scale=None, bool column_major_scales=False, "
        "int algorithm=0, int norm_weight=0, bool keep_norm=True) -> (Tensor quant_out, "
        "Tensor scales)",
        "tpfuse::allreduce_moe_finalize_add_rmsnorm(int team, Tensor expert_rows, "
        "Tensor routing_weights, Tensor residual, Tensor weight, float eps, "
        "Tensor? shared_expert=None, int algorithm=0) -> (Tensor norm_out, Tensor residual_out)",
        "tpfuse::allreduce_moe_finalize_add_rmsnorm_fp8(int team, Tensor expert_rows, "
        "Tensor routing_weights, Tensor residual, Tensor weight, float eps, int quant, "
        "Tensor? scale=None, bool column_major_scales=False, Tensor? shared_expert=None, "
        "int algorithm=0, bool keep_norm=True) -> (Tensor norm_out, Tensor residual_out, "
        "Tensor quant_out, Tensor scales)",
        "tpfuse::allreduce(int team, Tensor input, int algorithm=0) -> Tensor",
        "tpfuse::allreduce_qk_rmsnorm(int team, Tensor qkv, Tensor q_weight, Tensor k_weight, "
        "int q_size, int kv_size, int q_global_size, int k_global_size, int kv_replicas, "
        "float eps, Tensor? positions=None, Tensor? cos_sin_cache=None, int head_dim=0, "
        "int rotary_dim=0, int rope_style=0, int algorithm=0) -> (Tensor q, Tensor k)",
    ]

    def test_schemas_are_the_published_ones(self):
        import json
        described = json.loads(torch.ops.tpfuse.describe())["ops"]
        self.assertEqual(len(described), len(self.SCHEMAS))
        for schema in self.SCHEMAS:
            name = schema[len("tpfuse::"):schema.index("(")]
            self.assertIn(name, described)
            self.assertEqual(str(getattr(torch.ops.tpfuse, name).default._schema), schema)

    def test_python_follows_the_description(self):
        import inspect
        import json
        description = json.loads(torch.ops.tpfuse.describe())
        enums = description["enums"]
        self.assertEqual(tpfuse.ALGORITHMS, enums["Algorithm"])
        for python, cpp in ((tpfuse.Algorithm, "Algorithm"), (tpfuse.NormWeight, "NormWeight"),
                            (tpfuse.RopeStyle, "RopeStyle")):
            self.assertEqual({m.name.lower(): int(m) for m in python}, enums[cpp])
        self.assertEqual({m.name.lower(): int(m) for m in tpfuse.Quant},
                         {k: v for k, v in enums["QuantMode"].items() if k != "none"})
        # Each op's wrapper is tpfuse.<op>, but for the MoE ops': tpfuse's MoE wrapper has the
        # FP8 op's parameters (quant None calls the op without FP8 output).
        public = {name: name for name in description["ops"]}
        public["allreduce_moe_finalize_add_rmsnorm_fp8"] = public.pop(
            "allreduce_moe_finalize_add_rmsnorm")
        for name, wrapper_name in public.items():
            wrapper = getattr(tpfuse, wrapper_name)
            parameters = ["team"] + description["ops"][name]["python"]
            self.assertEqual(list(inspect.signature(wrapper).parameters), parameters)
            self.assertIs(wrapper.op, getattr(torch.ops.tpfuse, name).default)


class Compile(unittest.TestCase):
    """A team of one rank runs alone, so the ops can be checked and compiled without threads."""

    def setUp(self):
        (self.team,) = tpfuse.cpu_team(1)

    def tearDown(self):
        self.team.close()

    def test_opcheck(self):
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        weight = torch.ones(64, dtype=torch.bfloat16)
        torch.library.opcheck(
            torch.ops.tpfuse.allreduce_add_rmsnorm.default, (self.team.handle, x, x, weight, 1e-6, 0)
        )
        torch.library.opcheck(torch.ops.tpfuse.allreduce.default, (self.team.handle, x, 0))
        torch.library.opcheck(
            torch.ops.tpfuse.allreduce_add_rmsnorm_.default,
            (self.team.handle, x.clone(), x.clone(), weight, 1e-6, 0),
        )
        torch.library.opcheck(
            torch.ops.tpfuse.allreduce_add_rmsnorm.default,
            (self.team.handle, x, x, weight, 1e-6, 0, 1),
        )
        x128 = torch.randn(3, 256, dtype=torch.bfloat16)
        w128 = torch.ones(256, dtype=torch.bfloat16)
        for quant, scale, columns in ((1, torch.tensor([0.01]), False), (2, None, False),
                                      (3, None, False), (3, None, True)):
            torch.library.opcheck(
                torch.ops.tpfuse.allreduce_add_rmsnorm_fp8.default,
                (self.team.handle, x128, x128, w128, 1e-6, quant, scale, columns),
            )
            torch.library.opcheck(
                torch.ops.tpfuse.allreduce_add_rmsnorm_fp8_.default,
                (self.team.handle, x128.clone(), x128.clone(), w128, 1e-6, quant, scale, columns),
            )
            # Without the bf16 norm (keep_norm=False).
            torch.library.opcheck(
                torch.ops.tpfuse.allreduce_add_rmsnorm_fp8.default,
                (self.team.handle, x128, x128, w128, 1e-6, quant, scale, columns, 0, 0, False),
            )
            torch.library.opcheck(
                torch.ops.tpfuse.allreduce_add_rmsnorm_fp8_.default,
                (self.team.handle, x128.clone(), x128.clone(), w128, 1e-6, quant, scale, columns,
                 0, 0, False),
            )
        rows, weights = torch.randn(3, 2, 256, dtype=torch.bfloat16), torch.rand(3, 2)
        for shared in (None, x128):
            torch.library.opcheck(
                torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm.default,
                (self.team.handle, rows, weights, x128, w128, 1e-6, shared),
            )
            for keep_norm in (True, False):
                torch.library.opcheck(
                    torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm_fp8.default,
                    (self.team.handle, rows, weights, x128, w128, 1e-6, 3, None, False, shared, 0,
                     keep_norm),
                )
        qkv = torch.randn(3, 64 + 2 * 32, dtype=torch.bfloat16)
        torch.library.opcheck(
            torch.ops.tpfuse.allreduce_qk_rmsnorm.default,
            (self.team.handle, qkv, torch.ones(64, dtype=torch.bfloat16),
             torch.ones(32, dtype=torch.bfloat16), 64, 32, 64, 32, 1, 1e-6),
        )

    def test_meta_kernels_keep_a_dynamic_token_count_symbolic(self):
        # Each op on fake tensors whose token count is a symbol: outputs sized by that symbol,
        # and no guard added (one would fix a compiled graph to the count it was traced at).
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                           StatelessSymbolicContext)

        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env)
        tokens_dynamic = lambda dims: StatelessSymbolicContext(  # noqa: E731
            dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (dims - 1))
        fake = lambda t, dynamic=True: mode.from_tensor(  # noqa: E731
            t, symbolic_context=tokens_dynamic(t.dim()) if dynamic else None)
        x = fake(torch.empty(9, 384, dtype=torch.bfloat16))
        tokens = x.shape[0]
        self.assertIsInstance(tokens, torch.SymInt)
        w = fake(torch.empty(384, dtype=torch.bfloat16), dynamic=False)
        scale = fake(torch.ones(1), dynamic=False)
        rows = fake(torch.empty(9, 4, 384, dtype=torch.bfloat16))
        weights = fake(torch.empty(9, 4))
        qkv = fake(torch.empty(9, 64 + 2 * 32, dtype=torch.bfloat16))
        qw, kw = (fake(torch.empty(n, dtype=torch.bfloat16), dynamic=False) for n in (64, 32))
        ops = torch.ops.tpfuse
        handle = self.team.handle
        with mode:
            calls = {
                "allreduce_add_rmsnorm": ops.allreduce_add_rmsnorm(handle, x, x, w, 1e-6),
                "allreduce": (ops.allreduce(handle, x),),
                "allreduce_moe_finalize_add_rmsnorm": ops.allreduce_moe_finalize_add_rmsnorm(
                    handle, rows, weights, x, w, 1e-6),
                "allreduce_qk_rmsnorm": ops.allreduce_qk_rmsnorm(
                    handle, qkv, qw, kw, 64, 32, 64, 32, 1, 1e-6),
            }
            for quant, given in ((1, scale), (2, None), (3, None)):
                for columns in (False, True) if quant == 3 else (False,):
                    for keep in (True, False):
                        name = f"fp8 quant {quant} columns {columns} keep_norm {keep}"
                        calls[name] = ops.allreduce_add_rmsnorm_fp8(
                            handle, x, x, w, 1e-6, quant, given, columns, 0, 0, keep)
                        calls["in place " + name] = ops.allreduce_add_rmsnorm_fp8_(
                            handle, x, x, w, 1e-6, quant, given, columns, 0, 0, keep)
                        calls["moe " + name] = ops.allreduce_moe_finalize_add_rmsnorm_fp8(
                            handle, rows, weights, x, w, 1e-6, quant, given, columns, None, 0,
                            keep)
        self.assertEqual(env.guards, [], "a Meta kernel fixed the token count")
        for name, outputs in calls.items():
            for out in outputs:
                if out.numel() != 0:  # not keep_norm=False's [0, hidden], static's no scales
                    self.assertIsInstance(out.shape[0], torch.SymInt, f"{name}: {out.shape}")

    def test_wrappers_compile_into_one_graph(self):
        # The wrappers (enum names included) trace without a graph break.
        handle = self.team.handle

        def block(x, residual, weight):
            norm, residual = tpfuse.allreduce_add_rmsnorm(handle, x, residual, weight, 1e-6,
                                                          "oneshot", "gamma")
            q8, scales = tpfuse.allreduce_add_rmsnorm_fp8_(handle, norm.clone(), residual.clone(),
                                                           weight, 1e-6, "per_token")
            return norm * 2, residual, q8.float(), scales

        x = torch.randn(4, 128, dtype=torch.bfloat16)
        residual = torch.randn(4, 128, dtype=torch.bfloat16)
        weight = torch.ones(128, dtype=torch.bfloat16)
        compiled = torch.compile(block, fullgraph=True)
        for got, want in zip(compiled(x, residual, weight), block(x, residual, weight)):
            self.assertTrue(torch.equal(got, want))

    def test_compiled_graph_holds_the_op_and_matches_eager(self):
        handle = self.team.handle

        def block(x, residual, weight):
            norm, residual = torch.ops.tpfuse.allreduce_add_rmsnorm(handle, x, residual, weight, 1e-6)
            return norm * 2, residual

        x = torch.randn(4, 64, dtype=torch.bfloat16)
        residual = torch.randn(4, 64, dtype=torch.bfloat16)
        weight = torch.ones(64, dtype=torch.bfloat16)
        compiled = torch.compile(block, fullgraph=True)
        for got, want in zip(compiled(x, residual, weight), block(x, residual, weight)):
            self.assertTrue(torch.equal(got, want))


if __name__ == "__main__":
    unittest.main()
