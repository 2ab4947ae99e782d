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

    def __init__(self, config: Config, rank: int, world: int, device: torch.device):
        c, local = config, config.local(world)
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


def moe_experts(h: torch.Tensor, w: dict, config: Config,
                grouped: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's top-k expert outputs [tokens, k, hidden] (h's dtype) and their routing weights
    [tokens, k] (fp32): sigmoid scores, top-k by score + bias, weights normalized over the k; the
    experts through torch's grouped GEMM (`grouped`) or, for small batches, gathered per (token,
    expert) pair. Their combine (`moe_combine`) is the rank's partial MoE output."""
    tokens = h.shape[0]
    k = config.top_k
    scores = (h.float() @ w["router"]).sigmoid()
    _, chosen = (scores + w["router_bias"]).topk(k, dim=-1)
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
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

    def qk_norm_rope(self, qkv, w, positions, cos_sin, config, local, world):
        """(q, k): the QK norm over all heads (an all-reduce of the sums of squares), then RoPE."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def attention(h, w, layer_cache, slot, positions, cos_sin, collectives, config, local, world):
    """This rank's partial attention output: qkv, QK norm + RoPE, the new key/value written at
    `slot` (a one-element index tensor), attention over the whole cache, o_proj."""
    batch = h.shape[0]
    qkv = h @ w["qkv"]
    q, k = collectives.qk_norm_rope(qkv, w, positions, cos_sin, config, local, world)
    v = qkv[:, local.heads * config.head_dim + local.kv_heads * config.head_dim:]
    keys, values = layer_cache
    keys.index_copy_(2, slot, k.view(batch, local.kv_heads, 1, config.head_dim))
    values.index_copy_(2, slot, v.reshape(batch, local.kv_heads, 1, config.head_dim))
    out = F.scaled_dot_product_attention(
        q.view(batch, local.heads, 1, config.head_dim), keys, values, enable_gqa=True
    )
    return out.reshape(batch, local.heads * config.head_dim) @ w["o"]


def layer_forward(h, residual, w, next_norm, layer_cache, slot, positions, cos_sin, collectives,
                  config, local, world, grouped):
    """One decoder layer from its normalized input `h` and the residual stream; returns the next
    layer's normalized input (its input norm is `next_norm`) and the new residual stream."""
    partial = attention(h, w, layer_cache, slot, positions, cos_sin, collectives, config, local,
                        world)
    h, residual = collectives.add_rms_norm(partial, residual, w["post_norm"], config.eps)
    rows, weights = moe_experts(h, w, config, grouped)
    return collectives.moe_add_rms_norm(rows, weights, residual, next_norm, config.eps)


class Decoder:
    """The decode step of one rank: tokens [batch] at positions [batch] -> full logits."""

    def __init__(self, weights: Weights, cache: KvCache, collectives: Collectives, world: int,
                 grouped: bool, layers: Optional[int] = None, compile_layer: bool = False):
        self.w, self.cache, self.collectives = weights, cache, collectives
        self.config, self.local, self.world = weights.config, weights.local, world
        self.grouped = grouped
        self.layers = layers if layers is not None else self.config.layers
        self.layer = torch.compile(layer_forward, fullgraph=True) if compile_layer else layer_forward

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor):
        c = self.config
        x = self.w.embedding.index_select(0, tokens)
        residual = x
        h = rms_norm(x, self.w.layers[0]["input_norm"], c.eps)
        for i in range(self.layers):
            next_norm = (
                self.w.layers[i + 1]["input_norm"] if i + 1 < self.layers else self.w.final_norm
            )
            h, residual = self.layer(
                h, residual, self.w.layers[i], next_norm, self.cache.live[i], slot, positions,
                self.w.cos_sin, self.collectives, c, self.local, self.world, self.grouped,
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
