"""A MiniMax-M2-shaped decoder, tensor-parallel over torch.distributed, one process per rank.

Shapes from MiniMax-M2's published config: hidden 3072, 48 query heads and 8 KV heads of 128, the
QK norm over all heads (q 6144, k 1024 wide), partial rotary embedding (rotary_dim 64, rotate-half,
theta 5e6), 256 experts of intermediate 1536, top 8 by sigmoid scores plus a routing bias, top-k
weights normalized, rms_norm_eps 1e-6. Random weights, bf16. Layer and expert counts are options so
the model fits the GPUs.

Tensor parallelism over W ranks, as engines shard it: q/k/v column-parallel (48/W query heads, 8/W
KV heads per rank), o_proj row-parallel (all-reduce), every expert's gate/up column-parallel and
down row-parallel on the intermediate dimension (all-reduce), embedding and router replicated, the
LM head vocab-parallel with an all-gather of the logits. Per layer three collectives: the QK-norm
variance, after attention, after the MoE; each all-reduce is followed by residual add + RMSNorm.

The collectives and the norms after them are a `Collectives` strategy (modes in decode.py); the
rest of the model is the same code in every mode, so their outputs differ only where the fused ops
round once instead of several times.

FP8 (`Weights(fp8=True)`, decode.py --fp8): the attention projections (qkv, o) and the experts'
gate/up and down weights are float8 E4M3 with one fp32 scale per 128x128 block, quantized from the
same bf16 random weights (so the bf16 model is what the FP8 one approximates), and every GEMM
input is quantized per token and group of 128 channels (`quant_fp8_group`, the form tpfuse's
passes fold into the norm before it). The router reads the bf16 norm. The GEMMs (`fp8_matmul`):
on CUDA torch 2.11's block-scaled FP8 matmul (`aten._scaled_mm_v2`, what
`torch.nn.functional.scaled_mm` calls, with BlockWise1x128 activation scales and BlockWise128x128
weight scales: cuBLASLt on sm90); elsewhere (the CPU) the defined fallback, both operands
dequantized to fp32, one matmul, rounded once to bf16. torch 2.11 has no block-scaled grouped
GEMM on Hopper (its scaled grouped GEMM takes row-wise or MX scales), so the experts gather their
FP8 weights per (token, expert) pair and multiply a few pairs at a time in one block-scaled GEMM,
keeping the block diagonal (`moe_experts_fp8`): fine for decode batches, wasteful for large ones.

Weights are generated per rank shard from seeds (layer, name, rank): every mode of a run sees the
same model. Decode: one new token per sequence, attention over a KV cache of a fixed context
(written at a slot that advances each step), so a step's cost is that of decoding at that context.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Config:
    hidden: int = 3072
    heads: int = 48
    kv_heads: int = 8
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5e6
    experts: int = 256
    top_k: int = 8
    expert_inter: int = 1536
    vocab: int = 200064
    layers: int = 8
    eps: float = 1e-6
    max_position: int = 1 << 16

    def local(self, world: int) -> "Local":
        for name, value in (("heads", self.heads), ("expert_inter", self.expert_inter)):
            if value % world:
                raise ValueError(f"{name} {value} does not divide by the world size {world}")
        if self.vocab % world:
            raise ValueError(f"vocab {self.vocab} does not divide by the world size {world}")
        # KV heads fewer than ranks are replicated: each rank holds one.
        kv_replicas = max(1, world // self.kv_heads)
        return Local(
            heads=self.heads // world,
            kv_heads=max(1, self.kv_heads // world),
            kv_replicas=kv_replicas,
            inter=self.expert_inter // world,
            vocab=self.vocab // world,
        )

    def check_fp8(self, world: int) -> None:
        """Every FP8 GEMM's width and depth in whole 128-blocks (weights 128x128, activations
        1x128): raises naming the first that is not."""
        local = self.local(world)
        widths = {
            "hidden": self.hidden, "q width per rank": local.heads * self.head_dim,
            "q + k + v width per rank": (local.heads + 2 * local.kv_heads) * self.head_dim,
            "expert_inter per rank": local.inter,
        }
        for name, value in widths.items():
            if value % FP8_BLOCK:
                raise ValueError(f"--fp8: {name} {value} is not a multiple of {FP8_BLOCK}")


@dataclasses.dataclass
class Local:
    heads: int
    kv_heads: int
    kv_replicas: int
    inter: int
    vocab: int


def _random(shape, scale, seed, device, dtype=torch.bfloat16):
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=generator, device=device) * scale).to(dtype)


def _seed(*parts: int) -> int:
    value = 1469598103934665603
    for part in parts:
        value = ((value ^ (part & 0xFFFFFFFF)) * 1099511628211) % (1 << 61)
    return value


class Weights:
    """One rank's shard of the model's weights."""

    def __init__(self, config: Config, rank: int, world: int, device: torch.device,
                 fp8: bool = False):
        c, local = config, config.local(world)
        if fp8:
            config.check_fp8(world)
        self.fp8 = fp8
        self.fp8_check = None
        self.config, self.local = c, local
        q_size, kv_size = local.heads * c.head_dim, local.kv_heads * c.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        kv_rank = rank // local.kv_replicas  # the KV head group this rank holds
        r = rank
        self.embedding = _random((c.vocab, c.hidden), 1.0, _seed(1, 0), device)
        self.lm_head = _random((local.vocab, c.hidden), c.hidden**-0.5, _seed(2, r), device)
        self.final_norm = 1 + _random((c.hidden,), 0.05, _seed(3, 0), device)
        # cos | sin, fp32 [max_position, rotary_dim], as engines cache them.
        half = c.rotary_dim // 2
        inv_freq = c.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=device) / half)
        angles = torch.arange(c.max_position, dtype=torch.float64, device=device)[:, None] * inv_freq
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()
        self.layers = []
        for layer in range(c.layers):
            s = lambda name, part=r: _seed(100 + layer, name, part)  # noqa: E731
            w = {}
            w["input_norm"] = 1 + _random((c.hidden,), 0.05, s(1, 0), device)
            w["post_norm"] = 1 + _random((c.hidden,), 0.05, s(2, 0), device)
            q = _random((c.hidden, q_size), c.hidden**-0.5, s(3), device)
            k = _random((c.hidden, kv_size), c.hidden**-0.5, s(4, kv_rank), device)
            v = _random((c.hidden, kv_size), c.hidden**-0.5, s(5, kv_rank), device)
            w["qkv"] = torch.cat([q, k, v], dim=1).contiguous()
            w["q_norm"] = 1 + _random((q_size,), 0.05, s(6), device)
            w["k_norm"] = 1 + _random((kv_size,), 0.05, s(7, kv_rank), device)
            w["o"] = _random((q_size, c.hidden), (c.heads * c.head_dim) ** -0.5, s(8), device)
            w["router"] = _random((c.hidden, c.experts), c.hidden**-0.5, s(9, 0), device,
                                  torch.float32)
            w["router_bias"] = _random((c.experts,), 0.1, s(10, 0), device, torch.float32)
            # Experts stored [E, out, in] (the grouped GEMM takes them transposed).
            w["w13"] = _random((c.experts, 2 * local.inter, c.hidden), c.hidden**-0.5, s(11),
                               device)
            w["w2"] = _random((c.experts, c.hidden, local.inter), c.expert_inter**-0.5, s(12),
                              device)
            if fp8:
                # [out, in] for the GEMM (its weight operand is the transpose, column-major);
                # the bf16 copies go (the FP8 model holds its own weights only).
                bf16 = {name: w.pop(name) for name in ("qkv", "o", "w13", "w2")}
                for name in ("qkv", "o"):
                    w[name + "_fp8"] = quantize_fp8_blocks(bf16[name].t())
                for name in ("w13", "w2"):
                    w[name + "_fp8"] = quantize_fp8_blocks(bf16[name])
                if layer == 0:
                    self.fp8_check = fp8_gemm_check(w, bf16, _seed(13, r), device)
                del bf16
            self.layers.append(w)


class KvCache:
    """Per layer [batch, kv_heads, context, head_dim] keys and values, filled with random
    'earlier context'; reset() restores the initial contents so every mode starts alike."""

    def __init__(self, config: Config, local: Local, batch: int, context: int, rank: int,
                 device: torch.device):
        shape = (batch, local.kv_heads, context, config.head_dim)
        kv_rank = rank // local.kv_replicas
        self.initial = [
            (_random(shape, 1.0, _seed(7, layer, 0, kv_rank), device),
             _random(shape, 1.0, _seed(7, layer, 1, kv_rank), device))
            for layer in range(config.layers)
        ]
        self.live = [(k.clone(), v.clone()) for k, v in self.initial]

    def reset(self):
        for (k, v), (k0, v0) in zip(self.live, self.initial):
            k.copy_(k0)
            v.copy_(v0)


# --- FP8 E4M3 with block scales (DeepSeek-V3's and MiniMax-M2's format): weights one fp32 scale
# per 128x128 block, activations one per token and group of 128 channels, each scale
# max(amax, 1e-10) / 448 and q = e4m3(x / scale) (round to nearest even, saturating at 448).

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
FP8_MIN_AMAX = 1e-10
# Expert (token, expert) pairs multiplied in one block-scaled GEMM (moe_experts_fp8).
FP8_PAIRS_PER_GEMM = 16
# aten._scaled_mm_v2's recipes (torch.nn.functional.ScalingType's values). The op is called
# directly: torch.compile traces it, not F.scaled_mm's call of torch._scaled_mm_v2.
_BLOCKWISE_1X128 = 4
_BLOCKWISE_128X128 = 5


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def quant_fp8_group(x: torch.Tensor):
    """(q, scales [..., hidden / 128, 1]): x per token and group of 128 channels in E4M3, as
    model code writes it in torch ops (tpfuse's passes fold this form into the fused norm
    before it)."""
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    scales = xf.abs().amax(-1, keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    q = (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(x.shape)
    return q, scales


def fp8_activation(x: torch.Tensor):
    """(q [tokens, K], scales [tokens, K / 128]) of a GEMM input x [tokens, K]."""
    q, scales = quant_fp8_group(x)
    return q, scales.squeeze(-1)


def quantize_fp8_blocks(w: torch.Tensor, chunk: int = 16):
    """(q, scales) of weights w [..., N, K] (N, K multiples of 128): q e4m3 [..., N, K], contiguous;
    scales fp32 [..., N / 128, round_up(K / 128, 4)], one per 128x128 block, the columns past
    K / 128 padding (1.0; cuBLASLt's 128x128 scale layout has a leading dimension of whole
    16 bytes, which torch's aten._scaled_mm_v2 checks). 3-D weights go `chunk` at a time."""
    if w.dim() == 3 and w.shape[0] > chunk:
        parts = [quantize_fp8_blocks(w[i : i + chunk]) for i in range(0, w.shape[0], chunk)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    *lead, n, k = w.shape
    blocks = w.float().reshape(*lead, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    q = (blocks / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(w.shape).contiguous()
    padded = torch.ones(*lead, n // FP8_BLOCK, _round_up(k // FP8_BLOCK, 4), dtype=torch.float32,
                        device=w.device)
    padded[..., : k // FP8_BLOCK] = scales.reshape(*lead, n // FP8_BLOCK, k // FP8_BLOCK)
    return q, padded


def _column_major(scales: torch.Tensor) -> torch.Tensor:
    """scales [M, G] with strides (1, M), as the block-scaled GEMM takes activation scales (for
    M = 1 torch 2.11 wants (1, 1): the same memory as a row-major row, viewed so)."""
    m, g = scales.shape
    if scales.stride(0) == 1 and (g == 1 or scales.stride(1) == m):
        return scales
    if m == 1:
        return scales.contiguous().as_strided((1, g), (1, 1))
    return scales.t().contiguous().t()


def _dequantize(q: torch.Tensor, scales: torch.Tensor, rows_per_scale: int) -> torch.Tensor:
    """fp32 values of q [R, K] with scales [ceil(R / rows_per_scale), >= K / 128] (one per
    `rows_per_scale` rows and 128 columns)."""
    rows, k = q.shape
    scales = scales[:, : k // FP8_BLOCK]
    if rows_per_scale > 1:
        scales = scales.repeat_interleave(rows_per_scale, 0)[:rows]
    return (q.float().view(rows, k // FP8_BLOCK, FP8_BLOCK) * scales.unsqueeze(-1)).view(rows, k)


def fp8_matmul_dequantized(a_q, a_scales, w_q, w_scales) -> torch.Tensor:
    """The defined block-scaled product: both operands dequantized to fp32, one matmul, rounded
    once to bf16."""
    return (_dequantize(a_q, a_scales, 1) @ _dequantize(w_q, w_scales, FP8_BLOCK).t()).to(
        torch.bfloat16)


def fp8_matmul(a_q, a_scales, w_q, w_scales) -> torch.Tensor:
    """a @ w.T in bf16 [M, N] from a_q e4m3 [M, K] with a_scales [M, K / 128] (1x128 blocks, any
    layout) and w_q e4m3 [N, K] with w_scales [N / 128, round_up(K / 128, 4)] (128x128 blocks).
    CUDA: torch's block-scaled FP8 GEMM (aten._scaled_mm_v2, BlockWise1x128 x BlockWise128x128,
    cuBLASLt; sm90, CUDA 12.9+), a row-major, w as its column-major transpose, a's scales
    column-major, w's scales as the transpose of their contiguous [N / 128, round_up(K / 128, 4)]
    form, as torch 2.11's own samples lay them out. Elsewhere: fp8_matmul_dequantized (after the
    same relayout of a's scales, so that the CPU smoke run's compiled graphs hold the GPU's)."""
    a_scales = _column_major(a_scales)
    if not a_q.is_cuda:
        return fp8_matmul_dequantized(a_q, a_scales, w_q, w_scales)
    # cuBLASLt has no block-scaled algorithm for fewer than 4 rows on an H200 (measured:
    # CUBLAS_STATUS_NOT_SUPPORTED at 1 and 2 rows, 4-32 rows within 7e-4 of the definition):
    # the rows are padded to a multiple of 4 with zeros (scale 1) and the product sliced.
    rows = a_q.shape[0]
    padded_rows = _round_up(rows, 4)
    if padded_rows != rows:
        a_q = torch.cat([a_q, a_q.new_zeros(padded_rows - rows, a_q.shape[1])])
        ones = a_scales.new_ones(padded_rows - rows, a_scales.shape[1])
        a_scales = torch.cat([a_scales, ones]).t().contiguous().t()
    out = torch.ops.aten._scaled_mm_v2.default(
        a_q, w_q.t(), [a_scales], [_BLOCKWISE_1X128], [], [w_scales.t()],
        [_BLOCKWISE_128X128], [], None, torch.bfloat16, [], False,
    )
    return out[:rows] if padded_rows != rows else out


def fp8_gemm_check(w: dict, bf16: dict, seed: int, device: torch.device) -> dict:
    """Layer 0's FP8 GEMMs (qkv, o, expert 0's gate/up and down) on random activations of 1 and 8
    tokens: fp8_matmul against its dequantized definition (on CUDA: whether torch's block-scaled
    GEMM reads these layouts as defined; elsewhere it is the definition, 0) and against the bf16
    GEMM of the unquantized weights (the quantization's own error)."""
    weights = {"qkv": (w["qkv_fp8"], bf16["qkv"].t()), "o": (w["o_fp8"], bf16["o"].t()),
               "w13": ((w["w13_fp8"][0][0], w["w13_fp8"][1][0]), bf16["w13"][0]),
               "w2": ((w["w2_fp8"][0][0], w["w2_fp8"][1][0]), bf16["w2"][0])}
    check = {}
    for name, ((w_q, w_scales), reference) in weights.items():
        for tokens in (1, 8):
            x = _random((tokens, w_q.shape[1]), 1.0, seed + tokens, device)
            a_q, a_scales = fp8_activation(x)
            got = fp8_matmul(a_q, a_scales, w_q, w_scales)
            check[f"{name}_tokens{tokens}"] = {
                "rel_err_vs_dequantized": relative_error(
                    got, fp8_matmul_dequantized(a_q, a_scales, w_q, w_scales)),
                "rel_err_vs_bf16": relative_error(got, x.float() @ reference.float().t()),
            }
    return check


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF's MiniMax-M2 writes it (fp32 statistics, rounded to the dtype, then the
    weight): the form the FP8 mode's compiled layers use, because Inductor keeps its rounding when
    the output is upcast again to quantize (it drops F.rms_norm's, and with it the norm the passes
    match)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through torch's own op (one fused kernel on CUDA): the separate norm of the
    unfused modes is the best torch has, not a chain of elementwise kernels."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope(positions, q, k, cos_sin, head_dim, rotary_dim):
    """Rotate-half partial RoPE, as engines write it natively (vLLM's forward_native)."""
    cos, sin = cos_sin.index_select(0, positions).chunk(2, dim=-1)

    def rotate(x):
        shape = x.shape
        x = x.view(positions.shape[0], -1, head_dim)
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(rotated, 2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return torch.cat((rotated, passed), dim=-1).reshape(shape)

    return rotate(q), rotate(k)


def route(h: torch.Tensor, w: dict, config: Config) -> Tuple[torch.Tensor, torch.Tensor]:
    """(chosen experts [tokens, k], their routing weights [tokens, k] fp32) from the bf16 norm h:
    sigmoid scores, top-k by score + bias, weights normalized over the k."""
    scores = (h.float() @ w["router"]).sigmoid()
    _, chosen = (scores + w["router_bias"]).topk(config.top_k, dim=-1)
    weights = scores.gather(1, chosen)
    return chosen, weights / weights.sum(-1, keepdim=True)


def _gather_fp8(weights, index):
    """(q, scales) of the experts `index` [P] out of (q [E, N, K], scales [E, N / 128, L4]):
    [P * N, K] and [P * N / 128, L4], the pairs' weights stacked along N."""
    q, scales = weights
    q = q.view(torch.uint8).index_select(0, index).view(FP8)  # a byte gather, any dtype's
    scales = scales.index_select(0, index)
    return q.reshape(-1, q.shape[-1]), scales.reshape(-1, scales.shape[-1])


def _pairs_fp8_matmul(a_q, a_scales, weights, index, pairs_per_row):
    """Each row r of a [R, K] times the experts index[r * m : (r + 1) * m] (m = pairs_per_row):
    [R * m, N] bf16. Rows go a few at a time (FP8_PAIRS_PER_GEMM pairs): one block-scaled GEMM of
    those rows against their pairs' weights stacked along N, of which each row keeps its own
    block (the diagonal), so a decode step runs one or a few GEMMs instead of one a pair."""
    rows, m = a_q.shape[0], pairs_per_row
    n = weights[0].shape[1]
    step = max(1, FP8_PAIRS_PER_GEMM // m)
    outs = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w_q, w_scales = _gather_fp8(weights, index[r0 * m : r1 * m])
        full = fp8_matmul(a_q[r0:r1], a_scales[r0:r1], w_q, w_scales)  # [r, r * m * n]
        count = r1 - r0
        outs.append(full.view(count, count, m, n).diagonal(dim1=0, dim2=1).permute(2, 0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(rows * m, n).contiguous()


def moe_experts_fp8(h: torch.Tensor, h_q: torch.Tensor, h_scales: torch.Tensor, w: dict,
                    config: Config) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_experts in FP8: routed from the bf16 norm h, the experts' gate/up from its FP8 form
    (h_q, h_scales [tokens, hidden / 128]) and their down projection from the quantized SiLU
    product, each through block-scaled GEMMs over the (token, expert) pairs' gathered FP8
    weights (_pairs_fp8_matmul)."""
    tokens, k = h.shape[0], config.top_k
    chosen, weights = route(h, w, config)
    flat = chosen.flatten()  # token-major: pair t * k + j is token t's j-th expert
    up = _pairs_fp8_matmul(h_q, h_scales, w["w13_fp8"], flat, k)
    gate, lin = up.chunk(2, dim=-1)
    act_q, act_scales = fp8_activation(F.silu(gate) * lin)
    down = _pairs_fp8_matmul(act_q, act_scales, w["w2_fp8"], flat, 1)
    return down.view(tokens, k, -1), weights


def moe_experts(h: torch.Tensor, w: dict, config: Config,
                grouped: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's top-k expert outputs [tokens, k, hidden] (h's dtype) and their routing weights
    [tokens, k] (fp32): sigmoid scores, top-k by score + bias, weights normalized over the k; the
    experts through torch's grouped GEMM (`grouped`) or, for small batches, gathered per (token,
    expert) pair. Their combine (`moe_combine`) is the rank's partial MoE output."""
    tokens = h.shape[0]
    k = config.top_k
    chosen, weights = route(h, w, config)
    flat = chosen.flatten()
    if grouped:
        order = flat.argsort(stable=True)
        counts = torch.zeros(config.experts, dtype=torch.int32, device=h.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        rows = h.index_select(0, order // k)
        up = torch._grouped_mm(rows, w["w13"].transpose(-2, -1), offs=offsets)
        gate, lin = up.chunk(2, dim=-1)
        down = torch._grouped_mm((F.silu(gate) * lin).contiguous(), w["w2"].transpose(-2, -1),
                                 offs=offsets)
        out = torch.empty_like(down)
        out.index_copy_(0, order, down)
    else:
        rows = h.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, hidden]
        up = torch.bmm(rows, w["w13"].index_select(0, flat).transpose(-2, -1))
        gate, lin = up.chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * lin, w["w2"].index_select(0, flat).transpose(-2, -1))
    return out.view(tokens, k, -1), weights


def moe_combine(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routing-weighted sum of a token's k expert outputs, in fp32, rounded once."""
    return (rows.float() * weights.unsqueeze(-1)).sum(1).to(rows.dtype)


def moe(h: torch.Tensor, w: dict, config: Config, grouped: bool) -> torch.Tensor:
    """This rank's partial MoE output (sum over ranks = the layer's)."""
    return moe_combine(*moe_experts(h, w, config, grouped))


class Collectives:
    """The collective boundaries of a layer and the work after them (a mode)."""

    name = "abstract"

    def add_rms_norm(self, partial, residual, weight, eps) -> Tuple[torch.Tensor, torch.Tensor]:
        """(norm, residual): all-reduce of `partial`, + residual, RMSNorm."""
        raise NotImplementedError

    def moe_add_rms_norm(self, rows, weights, residual, weight, eps):
        """add_rms_norm of the MoE combine of `rows` [tokens, k, hidden] by `weights`."""
        return self.add_rms_norm(moe_combine(rows, weights), residual, weight, eps)

    def add_rms_norm_fp8(self, partial, residual, weight, eps):
        """(norm, residual, q, scales): add_rms_norm and the norm's FP8 form for the GEMMs that
        read it (per token group of 128, scales [tokens, hidden / 128]; the router reads the bf16
        norm). Here: the unfused quantization after the norm."""
        norm, residual = self.add_rms_norm(partial, residual, weight, eps)
        return (norm, residual, *fp8_activation(norm))

    def moe_add_rms_norm_fp8(self, rows, weights, residual, weight, eps):
        """moe_add_rms_norm with the norm's FP8 form, as add_rms_norm_fp8."""
        norm, residual = self.moe_add_rms_norm(rows, weights, residual, weight, eps)
        return (norm, residual, *fp8_activation(norm))

    def qk_norm_rope(self, qkv, w, positions, cos_sin, config, local, world):
        """(q, k): the QK norm over all heads (an all-reduce of the sums of squares), then RoPE."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def attention(h, w, layer_cache, slot, positions, cos_sin, collectives, config, local, world):
    """This rank's partial attention output: qkv, QK norm + RoPE, the new key/value written at
    `slot` (a one-element index tensor), attention over the whole cache, o_proj. In FP8, h is the
    normalized input's FP8 form (q, scales) and o_proj's input is quantized the same way."""
    fp8 = isinstance(h, tuple)
    batch = h[0].shape[0] if fp8 else h.shape[0]
    qkv = fp8_matmul(*h, *w["qkv_fp8"]) if fp8 else h @ w["qkv"]
    q, k = collectives.qk_norm_rope(qkv, w, positions, cos_sin, config, local, world)
    v = qkv[:, local.heads * config.head_dim + local.kv_heads * config.head_dim:]
    keys, values = layer_cache
    keys.index_copy_(2, slot, k.view(batch, local.kv_heads, 1, config.head_dim))
    values.index_copy_(2, slot, v.reshape(batch, local.kv_heads, 1, config.head_dim))
    out = F.scaled_dot_product_attention(
        q.view(batch, local.heads, 1, config.head_dim), keys, values, enable_gqa=True
    )
    out = out.reshape(batch, local.heads * config.head_dim)
    return fp8_matmul(*fp8_activation(out), *w["o_fp8"]) if fp8 else out @ w["o"]


def layer_forward(h, residual, w, next_norm, layer_cache, slot, positions, cos_sin, collectives,
                  config, local, world, grouped):
    """One decoder layer from its normalized input `h` and the residual stream; returns the next
    layer's normalized input (its input norm is `next_norm`) and the new residual stream."""
    partial = attention(h, w, layer_cache, slot, positions, cos_sin, collectives, config, local,
                        world)
    h, residual = collectives.add_rms_norm(partial, residual, w["post_norm"], config.eps)
    rows, weights = moe_experts(h, w, config, grouped)
    return collectives.moe_add_rms_norm(rows, weights, residual, next_norm, config.eps)


def layer_forward_fp8(h, h_q, h_scales, residual, w, next_norm, layer_cache, slot, positions,
                      cos_sin, collectives, config, local, world, grouped):
    """layer_forward in FP8: from the normalized input (bf16, and its FP8 form for qkv), to the
    next layer's (h, residual, h_q, h_scales). Both norms quantize their output in the collective
    step (`*_fp8`), where tpfuse fuses it."""
    partial = attention((h_q, h_scales), w, layer_cache, slot, positions, cos_sin, collectives,
                        config, local, world)
    h, residual, h_q, h_scales = collectives.add_rms_norm_fp8(partial, residual, w["post_norm"],
                                                              config.eps)
    rows, weights = moe_experts_fp8(h, h_q, h_scales, w, config)
    return collectives.moe_add_rms_norm_fp8(rows, weights, residual, next_norm, config.eps)


class Decoder:
    """The decode step of one rank: tokens [batch] at positions [batch] -> full logits."""

    def __init__(self, weights: Weights, cache: KvCache, collectives: Collectives, world: int,
                 grouped: bool, layers: Optional[int] = None, compile_layer: bool = False):
        self.w, self.cache, self.collectives = weights, cache, collectives
        self.config, self.local, self.world = weights.config, weights.local, world
        self.grouped = grouped
        self.layers = layers if layers is not None else self.config.layers
        forward = layer_forward_fp8 if weights.fp8 else layer_forward
        self.layer = torch.compile(forward, fullgraph=True) if compile_layer else forward

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor):
        c = self.config
        x = self.w.embedding.index_select(0, tokens)
        residual = x
        h = rms_norm(x, self.w.layers[0]["input_norm"], c.eps)
        quantized = fp8_activation(h) if self.w.fp8 else ()  # layer 0's qkv input
        for i in range(self.layers):
            next_norm = (
                self.w.layers[i + 1]["input_norm"] if i + 1 < self.layers else self.w.final_norm
            )
            h, residual, *quantized = self.layer(
                h, *quantized, residual, self.w.layers[i], next_norm, self.cache.live[i], slot,
                positions, self.w.cos_sin, self.collectives, c, self.local, self.world,
                self.grouped,
            )
        logits = self.collectives.all_gather(h @ self.w.lm_head.t())  # [batch, vocab]
        return logits


def grouped_gemm_works(device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs here for bf16 (it needs sm90 on CUDA)."""
    try:
        a = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
        b = torch.randn(2, 32, 64, device=device, dtype=torch.bfloat16)
        offsets = torch.tensor([1, 4], device=device, dtype=torch.int32)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tokens_per_second(batch: int, ms: float):
    """Output tokens per second of a step of `ms` (None when the time is not positive: a fit of
    noisy figures, which a result must not turn into a number)."""
    return batch / (ms / 1e3) if ms > 0 else None
