"""torch.compile (Inductor) passes that rewrite unfused graphs into tpfuse's fused ops.

    import tpfuse, tpfuse.passes
    team = tpfuse.Team.from_group(group)
    fusion = tpfuse.passes.install(team, group)   # before torch.compile runs
    model = torch.compile(model)
    fusion.stats, fusion.graphs                   # rewrites, and each graph's ops before/after

Each pattern is a class with a ``pattern`` and a ``replacement`` written as plain torch code and
traced by Inductor's pattern matcher (post-grad). On the installed group:

- an all-reduce as torch.compile emits it (functional ``all_reduce`` + ``wait_tensor``, its sum
  possibly reshaped from [tokens, hidden] to the residual's [batch, seq, hidden]), an optional
  residual add, and RMSNorm as models write it (the fp32-upcast form with the weight on
  either side, ``torch.nn.functional.rms_norm``, or Gemma's zero-centered ``(1 + weight)`` form),
  any eps and width, becomes one ``tpfuse::allreduce_add_rmsnorm``. A token count fixed at compile
  time for which the team would take its NCCL path anyway keeps the unfused graph; a symbolic
  count is rewritten and the op chooses at run time.
- MiniMax-M2's QK norm as a TP engine writes it (one all-reduce of both mean squares, q and k
  split or sliced from one packed qkv) becomes one ``tpfuse::allreduce_qk_rmsnorm``; a second
  stage folds the rotate-half partial RoPE applied to its outputs (vLLM's ``forward_native``).
- The FP8 E4M3 quantization of a fused norm's output as model code writes it (``quant_fp8_static``,
  ``quant_fp8_per_token``, ``quant_fp8_group`` below: per tensor with a static scale, per token,
  per token group of 128) becomes that op's FP8 output (``tpfuse::allreduce_add_rmsnorm_fp8``),
  its norm output kept for its other readers (a third stage). A norm whose bf16 output is only
  upcast again must keep its rounding in the graph: Inductor's joint-graph ``pointless_convert``
  drops the rounding of norms computed in fp32 and cast at the end (``F.rms_norm``, the
  zero-centered form) when they are upcast, and those sites stay unfused; the weight-first and
  weight-last forms (HF's Llama and MiniMax-M2, vLLM's ``forward_native``) round before the
  weight and are fused.

Numerics: the fused op sums in fp32 and rounds once, so its outputs can differ from the unfused
graph's (which rounds the all-reduce, then the add) in the last bits.
"""

from __future__ import annotations

import hashlib
import operator
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    fwd_only,
    fx_to_pattern,
    gen_pattern,
    is_match,
    register_graph_pattern,
    register_replacement,
)
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._subclasses.fake_tensor import FakeTensorMode

from .ops import QUANT_GROUP_SIZE, QUANT_MIN_AMAX, Algorithm, NormWeight, Quant, RopeStyle
from .team import Team

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
FUSED_NORM = torch.ops.tpfuse.allreduce_add_rmsnorm.default
FUSED_QK = torch.ops.tpfuse.allreduce_qk_rmsnorm.default

# Exactly representable in fp32 (rms_norm's decomposition rounds eps to it) and in no pattern
# otherwise, so the tracer can tell the eps placeholder from the other constants.
_EXAMPLE_EPS = 2.0**-20


def op_arguments(node: torch.fx.Node) -> Dict[str, Any]:
    """A call's arguments by the op schema's names, defaults filled in."""
    schema = node.target._schema
    values = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            values[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


# --- dims: a traced pattern holds the spelling its own trace produced (mean(-1) gives [-1],
# rms_norm gives [ndim - 1], x[..., :n] gives ndim - 1, w[..., None] unsqueezes at ndim where
# w.unsqueeze(-1) says -1), and the graph may hold either; both sides are brought to -1 before
# matching, and the graph's untouched nodes get theirs back afterwards.

_DIM_POSITION = {
    aten.mean.dim: 1, aten.cat.default: 1, aten.split.Tensor: 2,
    aten.split_with_sizes.default: 2, aten.slice.Tensor: 1, aten.unsqueeze.default: 1,
}


def _last_dim_as_minus_one(graph: torch.fx.Graph) -> Dict[torch.fx.Node, tuple]:
    """Rewrites last-dim arguments to -1 (a slice's absent start to 0); returns the originals."""
    originals = {}
    for node in graph.nodes:
        position = _DIM_POSITION.get(node.target)
        if node.op != "call_function" or position is None or len(node.args) <= position:
            continue
        source = node.args[0][0] if node.target is aten.cat.default else node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if value is None:
            continue
        args = list(node.args)
        dim = args[position]
        # unsqueeze's last position is one past its input's last dim.
        last = value.dim() if node.target is aten.unsqueeze.default else value.dim() - 1
        if node.target is aten.unsqueeze.default:
            if isinstance(dim, int) and dim == last:
                args[position] = -1
        elif isinstance(dim, (list, tuple)) and len(dim) == 1 and dim[0] == last:
            args[position] = [-1]
        elif isinstance(dim, int) and dim == last:
            args[position] = -1
        if node.target is aten.slice.Tensor and len(args) > 2 and args[2] is None:
            args[2] = 0
        if tuple(args) != node.args:
            originals[node] = node.args
            node.args = tuple(args)
    return originals


def _trace(fn: Callable, args: Sequence[Any]) -> torch.fx.GraphModule:
    """fwd_only, then what Inductor has done to a graph by the time the post-grad custom pass
    sees it: no in-place ops (rms_norm's decomposition adds eps in place), views as reshapes."""
    decomposed = fwd_only(fn, args)
    with torch.no_grad():
        graph_module = make_fx(torch.func.functionalize(decomposed, remove="mutations"))(*args)
    graph_module.graph.eliminate_dead_code()
    view_to_reshape(graph_module)
    _last_dim_as_minus_one(graph_module.graph)
    graph_module.recompile()
    return graph_module


def _specific_pattern(fn: Callable, values: Sequence[Any], argnames: Sequence[str]):
    """What register_replacement checks a match against: `fn` traced again at the match's own
    values, with no constant ignored. Under dynamic shapes the trace computes sizes from its
    inputs (aten.sym_size) where the graph takes them from wherever it has them (a SymInt graph
    input, say): each size becomes an argument of its own, so that it matches any node, and the
    same node wherever it is used (as register_replacement does with its symbolic arguments)."""
    with torch._dynamo.utils.detect_fake_mode(values):
        traced = _trace(fn, values)
    graph = traced.graph
    names = list(argnames)
    last_placeholder = [node for node in graph.nodes if node.op == "placeholder"][-1]
    for node in list(graph.nodes):
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt):
            with graph.inserting_after(last_placeholder):
                size = graph.placeholder(f"_size{len(names)}")
            last_placeholder = size
            node.replace_all_uses_with(size)
            names.append(size.name)
    graph.eliminate_dead_code()
    traced.recompile()
    return fx_to_pattern(traced, argnames=names)


def _fake_inputs(*specs) -> list:
    """Example inputs for tracing: fake tensors, so no collective runs while registering."""
    with FakeTensorMode():
        return [torch.empty(*shape, dtype=dtype) for shape, dtype in specs]


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


def _rstd(hf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


# The RMSNorm forms, each (h, weight, eps) -> output in h's dtype, and the op's norm_weight for it.
def _norm_weight_first(h, weight, eps):
    hf = h.to(torch.float32)
    return weight * (hf * _rstd(hf, eps)).to(h.dtype)


def _norm_weight_last(h, weight, eps):
    hf = h.to(torch.float32)
    return (hf * _rstd(hf, eps)).to(h.dtype) * weight


def _norm_functional(h, weight, eps):
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps)


def _norm_zero_centered(h, weight, eps):
    # HF's GemmaRMSNorm (and Qwen3-Next's): the weight stored around 0, applied in fp32.
    hf = h.float()
    return (hf * _rstd(hf, eps) * (1.0 + weight.float())).type_as(h)


# (Enum values as plain ints in the graphs: the op's schema takes int.)
NORM_FORMS: Dict[str, tuple] = {
    "weight_first": (_norm_weight_first, int(NormWeight.GAMMA)),
    "weight_last": (_norm_weight_last, int(NormWeight.GAMMA)),
    "functional": (_norm_functional, int(NormWeight.GAMMA)),
    "zero_centered": (_norm_zero_centered, int(NormWeight.ONE_PLUS_GAMMA)),
}


class FusedPattern:
    """One rewrite: `pattern` and `replacement` (same arguments, same outputs), traced at
    registration on `example_inputs()`; `check` holds what tracing cannot (dtypes, sizes, the
    team's choice)."""

    stat = ""

    def __init__(self, fusion: "TpfusePass"):
        self.fusion = fusion

    def example_inputs(self) -> list:
        raise NotImplementedError

    def check(self, match: Match) -> bool:
        return True

    def _check_and_count(self, match: Match) -> bool:
        # Called by the matcher on the match it then rewrites, after the pattern re-traced at its
        # shapes matched too.
        if not self.check(match):
            return False
        self.fusion.stats[self.stat] += 1
        return True

    def register(self, patterns: PatternMatcherPass) -> None:
        register_replacement(
            self.pattern, self.replacement, self.example_inputs(), _trace, patterns,
            extra_check=self._check_and_count, scalar_workaround={"eps": _EXAMPLE_EPS},
        )


def _norm_inputs_fit(kwargs, fusion: "TpfusePass", reshaped: bool = False) -> bool:
    x = kwargs["x"].meta.get("val")
    weight = kwargs["weight"].meta.get("val")
    if x is None or weight is None or x.dim() < 1:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return False
    residual = kwargs.get("residual")
    if residual is not None:
        value = residual.meta.get("val")
        if value is None or value.dtype != x.dtype:
            return False
        if reshaped:
            # Only the token dims may be regrouped ([T, H] -> [B, S, H]): rows stay rows.
            if value.dim() < 1 or not statically_known_true(value.shape[-1] == x.shape[-1]):
                return False
            if not statically_known_true(value.numel() == x.numel()):
                return False
        elif value.shape != x.shape:
            return False
    return fusion.fused_kernel_runs(x)


class AllReduceAddRMSNorm(FusedPattern):
    """h = all_reduce(x) + residual (either order); (norm(h) * weight, h) -> one fused call.
    `reshaped`: the sum is reshaped to the residual's shape before the add (a MoE block that
    all-reduces its flattened [tokens, hidden] output, as HF transformers' MiniMax-M2 does)."""

    stat = "allreduce_add_rmsnorm"

    def __init__(self, fusion, norm_form: str, residual_first: bool, reshaped: bool = False):
        super().__init__(fusion)
        self.norm, self.norm_weight = NORM_FORMS[norm_form]
        self.residual_first = residual_first
        self.reshaped = reshaped

    def example_inputs(self):
        residual_shape = (5, 1, 16) if self.reshaped else (5, 16)
        return _fake_inputs(((5, 16), torch.bfloat16), (residual_shape, torch.bfloat16),
                            ((16,), torch.bfloat16))

    def pattern(self, x, residual, weight, eps):
        reduced = _all_reduce(x, self.fusion.group_name)
        if self.reshaped:
            reduced = reduced.reshape(residual.shape)
        h = residual + reduced if self.residual_first else reduced + residual
        return self.norm(h, weight, eps), h

    def replacement(self, x, residual, weight, eps):
        if self.reshaped:
            x = x.reshape(residual.shape)
        return self.fusion.fused_add_rmsnorm(x, residual, weight, eps, self.norm_weight)

    def check(self, match):
        return _norm_inputs_fit(match.kwargs, self.fusion, self.reshaped)


class AllReduceRMSNorm(FusedPattern):
    """No residual: h = all_reduce(x) (which may be used elsewhere); (norm(h) * weight, h)."""

    stat = "allreduce_add_rmsnorm"

    def __init__(self, fusion, norm_form: str):
        super().__init__(fusion)
        self.norm, self.norm_weight = NORM_FORMS[norm_form]

    def example_inputs(self):
        return _fake_inputs(((5, 16), torch.bfloat16), ((16,), torch.bfloat16))

    def pattern(self, x, weight, eps):
        h = _all_reduce(x, self.fusion.group_name)
        return self.norm(h, weight, eps), h

    def replacement(self, x, weight, eps):
        return self.fusion.fused_add_rmsnorm(x, None, weight, eps, self.norm_weight)

    def check(self, match):
        return _norm_inputs_fit(match.kwargs, self.fusion)


# --- The MoE combine before the all-reduce, folded into the fused op: this rank's top-k expert
# rows [tokens, k, hidden] weighted by their routing weights [tokens, k] and summed over k.

FUSED_MOE = torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm.default

# The combine forms matched: (rows.float() * w[..., None]).sum(1).to(dtype) and the same with the
# upcast left to type promotion (fp32 weights), or rows * w[..., None] summed in the rows' dtype
# (weights in that dtype; the fused op's fp32 products and sum are then the more exact).
MOE_COMBINE_FORMS = ("upcast", "promoted", "in_dtype")


def _moe_combine(rows, weights, form: str):
    if form == "upcast":
        return (rows.float() * weights.unsqueeze(-1)).sum(1).to(rows.dtype)
    if form == "promoted":
        return (rows * weights.unsqueeze(-1)).sum(1).to(rows.dtype)
    return (rows * weights.unsqueeze(-1)).sum(1)


class MoeFinalizeAddRMSNorm(FusedPattern):
    """all_reduce(combine(rows, weights)) + residual (either order), then the norm ->
    tpfuse::allreduce_moe_finalize_add_rmsnorm (the MoE finalize needs the residual and the
    plain weight)."""

    stat = "allreduce_moe_finalize_add_rmsnorm"

    def __init__(self, fusion, norm_form: str, residual_first: bool, combine: str):
        super().__init__(fusion)
        self.norm, _ = NORM_FORMS[norm_form]
        self.residual_first = residual_first
        self.combine = combine

    def example_inputs(self):
        weights = torch.bfloat16 if self.combine == "in_dtype" else torch.float32
        return _fake_inputs(((5, 2, 16), torch.bfloat16), ((5, 2), weights),
                            ((5, 16), torch.bfloat16), ((16,), torch.bfloat16))

    def pattern(self, rows, weights, residual, weight, eps):
        reduced = _all_reduce(_moe_combine(rows, weights, self.combine), self.fusion.group_name)
        h = residual + reduced if self.residual_first else reduced + residual
        return self.norm(h, weight, eps), h

    def replacement(self, rows, weights, residual, weight, eps):
        return FUSED_MOE(self.fusion.team, rows, weights, residual, weight, eps)

    def check(self, match):
        kwargs = match.kwargs
        values = [kwargs[name].meta.get("val") for name in ("rows", "weights", "residual")]
        if any(value is None for value in values):
            return False
        rows, weights, residual = values
        if rows.dim() != 3 or rows.dtype not in (torch.bfloat16, torch.float16):
            return False
        if not isinstance(rows.shape[1], int) or not 1 <= rows.shape[1] <= 16:
            return False
        wanted = rows.dtype if self.combine == "in_dtype" else torch.float32
        if weights.dtype != wanted or weights.dim() != 2 or residual.dim() != 2:
            return False
        if not (rows.is_contiguous() and weights.is_contiguous() and residual.is_contiguous()):
            return False
        if residual.dtype != rows.dtype or residual.shape[-1] != rows.shape[-1]:
            return False
        # The norm's inputs as the plain pattern checks them (the combine is the residual's
        # shape and dtype).
        fit = {"x": kwargs["residual"], "weight": kwargs["weight"], "residual": kwargs["residual"]}
        return _norm_inputs_fit(fit, self.fusion)


# --- MiniMax-M2's QK norm: per-rank mean squares of q and k, one all-reduce of both (cat'd),
# divided by the world size, normalized, weighted, back to the input dtype.


def _qk_norm(q, k, q_weight, k_weight, eps, world_size: int, group_name: str):
    dtype = q.dtype
    qf, kf = q.float(), k.float()
    both = torch.cat([qf.pow(2).mean(-1, keepdim=True), kf.pow(2).mean(-1, keepdim=True)], -1)
    q_variance, k_variance = (_all_reduce(both, group_name) / world_size).chunk(2, dim=-1)
    q_out = qf * torch.rsqrt(q_variance + eps) * q_weight
    k_out = kf * torch.rsqrt(k_variance + eps) * k_weight
    return q_out.to(dtype), k_out.to(dtype)


class _QkNorm(FusedPattern):
    stat = "allreduce_qk_rmsnorm"
    _q_size, _kv_size = 32, 16

    def example_inputs(self):
        q_size, kv_size = self._q_size, self._kv_size
        return _fake_inputs(((3, q_size + 2 * kv_size), torch.bfloat16),
                            ((q_size,), torch.bfloat16), ((kv_size,), torch.bfloat16))

    def norm(self, q, k, q_weight, k_weight, eps):
        return _qk_norm(q, k, q_weight, k_weight, eps, self.fusion.world_size,
                        self.fusion.group_name)

    def fused(self, qkv, q_weight, k_weight, eps):
        q_size, kv_size = q_weight.shape[0], k_weight.shape[0]
        world = self.fusion.world_size
        # Mean squares over ranks / world == sums over ranks / (width * world): the op's form.
        q, k = FUSED_QK(
            self.fusion.team, qkv.reshape(-1, qkv.shape[-1]), q_weight, k_weight,
            q_size=q_size, kv_size=kv_size, q_global_size=q_size * world,
            k_global_size=kv_size * world, kv_replicas=1, eps=eps,
        )
        return q.view(*qkv.shape[:-1], q_size), k.view(*qkv.shape[:-1], kv_size)

    def check(self, match):
        qkv = match.kwargs["qkv"].meta.get("val")
        if qkv is None or qkv.dtype not in (torch.bfloat16, torch.float16):
            return False
        if not qkv.is_contiguous():
            return False
        widths = []
        for name in ("q_weight", "k_weight"):
            weight = match.kwargs[name].meta.get("val")
            if weight is None or weight.dtype != qkv.dtype or weight.dim() != 1:
                return False
            widths.append(weight.shape[0])
        return widths[0] + 2 * widths[1] == qkv.shape[-1]


class QkNormSingleSplit(_QkNorm):
    """q, k, v = qkv.split([q_size, kv_size, kv_size], -1), then the QK norm of q and k. The
    split's user count is part of the traced pattern, so a v that is used and one that is not are
    two registrations (`returns_v`)."""

    def __init__(self, fusion, returns_v: bool):
        super().__init__(fusion)
        self.returns_v = returns_v

    def pattern(self, qkv, q_weight, k_weight, eps):
        kv_size = k_weight.shape[0]
        q, k, v = qkv.split([q_weight.shape[0], kv_size, kv_size], dim=-1)
        q, k = self.norm(q, k, q_weight, k_weight, eps)
        return (q, k, v) if self.returns_v else (q, k)

    def replacement(self, qkv, q_weight, k_weight, eps):
        q, k = self.fused(qkv, q_weight, k_weight, eps)
        if not self.returns_v:
            return q, k
        return q, k, qkv[..., q_weight.shape[0] + k_weight.shape[0]:]


class QkNormSlices(_QkNorm):
    """q = qkv[..., :q_size], k = qkv[..., q_size:q_size + kv_size], then the QK norm."""

    def pattern(self, qkv, q_weight, k_weight, eps):
        q_size, kv_size = q_weight.shape[0], k_weight.shape[0]
        q, k = qkv[..., :q_size], qkv[..., q_size:q_size + kv_size]
        return self.norm(q, k, q_weight, k_weight, eps)

    def replacement(self, qkv, q_weight, k_weight, eps):
        return self.fused(qkv, q_weight, k_weight, eps)


# --- RoPE after the QK norm, folded into the fused op (a second stage, on graphs the QK patterns
# rewrote). Not matched (left unfused): the interleaved style, full-width rotary
# (rotary_dim == head_dim), a cache that is not fp32 [positions, rotary_dim], tokens not 2-D.


def rope_native(positions, q, k, cos_sin_cache, head_dim: int, rotary_dim: int):
    """Rotate-half partial RoPE as engines write it natively (vLLM's forward_native)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)

    def rotate(x):
        shape = x.shape
        x = x.view(positions.shape[0], -1, head_dim)
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(rotated, 2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return torch.cat((rotated, passed), dim=-1).reshape(shape)

    return rotate(q), rotate(k)


class QkNormRope(FusedPattern):
    """rope_native on the two outputs of a fused QK norm (run without RoPE) -> that op with RoPE.

    The replacement must carry over the QK op's own arguments, which register_replacement's
    replacement (it sees only the matched tensors) cannot reach: the pattern is traced, and the op
    it hangs on, and its head_dim (not an input of the pattern), are found by hand in `check`."""

    stat = "allreduce_qk_rmsnorm_rope"
    _head_dim, _rotary_dim = 24, 8
    argnames = ["q", "k", "positions", "cos_sin_cache"]

    def example_inputs(self, head_dim: int = _head_dim, rotary_dim: int = _rotary_dim):
        return _fake_inputs(((3, 2 * head_dim), torch.bfloat16), ((3, head_dim), torch.bfloat16),
                            ((3,), torch.int64), ((7, rotary_dim), torch.float32))

    @staticmethod
    def pattern(head_dim: int):
        def rope(q, k, positions, cos_sin_cache):
            return rope_native(positions, q, k, cos_sin_cache, head_dim, cos_sin_cache.shape[1])

        return rope

    def replacement(self, op: torch.fx.Node, head_dim: int, rotary_dim: int, swapped: bool):
        """The op with RoPE, with `op`'s own arguments (by name), and its inputs."""
        arguments = op_arguments(op)

        def fused(qkv, q_weight, k_weight, positions, cos_sin_cache):
            q, k = FUSED_QK(
                arguments["team"], qkv, q_weight, k_weight, q_size=arguments["q_size"],
                kv_size=arguments["kv_size"], q_global_size=arguments["q_global_size"],
                k_global_size=arguments["k_global_size"], kv_replicas=arguments["kv_replicas"],
                eps=arguments["eps"], positions=positions, cos_sin_cache=cos_sin_cache,
                head_dim=head_dim, rotary_dim=rotary_dim, rope_style=int(RopeStyle.NEOX),
                algorithm=arguments["algorithm"],
            )
            return (k, q) if swapped else (q, k)

        return fused, [arguments["qkv"], arguments["q_weight"], arguments["k_weight"]]

    def register(self, patterns: PatternMatcherPass) -> None:
        generic = gen_pattern(self.pattern(self._head_dim), self.example_inputs(), _trace)
        register_graph_pattern(generic, extra_check=self.check, pass_dict=patterns)(self.rewrite)

    @staticmethod
    def qk_op_of(q: torch.fx.Node, k: torch.fx.Node) -> Optional[torch.fx.Node]:
        """The fused QK norm (without RoPE) whose outputs 0 and 1 are q and k, in either order
        (the two chains are alike, so the matcher may bind them either way), used only here."""
        if q.target is not operator.getitem or k.target is not operator.getitem:
            return None
        op = q.args[0]
        if k.args[0] is not op or {q.args[1], k.args[1]} != {0, 1}:
            return None
        if not isinstance(op, torch.fx.Node) or op.target != FUSED_QK or len(op.users) != 2:
            return None
        if (len(q.users) != 1 or len(k.users) != 1
                or op_arguments(op)["rope_style"] != RopeStyle.NONE):
            return None
        return op

    def geometry(self, match: Match):
        """(op, head_dim, rotary_dim, swapped) when the match is the pattern at its own sizes."""
        kwargs = match.kwargs
        q_node, k_node = kwargs["q"], kwargs["k"]
        op = self.qk_op_of(q_node, k_node)
        if op is None:
            return None
        values = [kwargs[name].meta.get("val") for name in self.argnames]
        if any(value is None for value in values):
            return None
        q, k, positions, cache = values
        heads = next(iter(q_node.users)).meta.get("val")
        if q.dim() != 2 or k.dim() != 2 or heads is None or heads.dim() != 3:
            return None
        head_dim, rotary_dim = heads.shape[-1], cache.shape[-1] if cache.dim() == 2 else 0
        if not isinstance(head_dim, int) or q.shape[1] % head_dim or k.shape[1] % head_dim:
            return None
        if not 0 < rotary_dim < head_dim or rotary_dim % 2:
            return None
        if cache.dtype != torch.float32 or not cache.is_contiguous():
            return None
        if positions.dtype != torch.int64 or positions.dim() != 1:
            return None
        # What register_replacement does for its patterns: the pattern again at these sizes,
        # with no constant ignored.
        specific = _specific_pattern(self.pattern(head_dim), values, self.argnames)
        if not is_match(specific.match(match.output_nodes()[0])):
            return None
        return op, head_dim, rotary_dim, q_node.args[1] == 1

    def check(self, match):
        return self.geometry(match) is not None

    def rewrite(self, match: Match, *args, **kwargs) -> None:
        fused, inputs = self.replacement(*self.geometry(match))
        match.replace_by_example(fused, inputs + [kwargs["positions"], kwargs["cos_sin_cache"]])
        self.fusion.stats[self.stat] += 1


# --- The norm's FP8 output, quantized as model code writes it in torch ops, folded into the fused
# op the first stage made (a third stage, on graphs the norm patterns rewrote). Matched: the
# division form with the clamp to +-448 before the cast, per tensor (a static fp32 scale of one
# element), per token, and per token group of 128 along hidden, the dynamic scales as
# max(amax, 1e-10) / 448 over the norm output upcast to fp32 (SGLang's and DeepSeek's reference
# form). Not matched (left unfused, as the ops differ in bits): a multiply by the scale's
# reciprocal, a floor on the scale instead of the amax or any other floor, amax taken before the
# upcast with its floor in bf16, column-major scales (call the op with column_major_scales), and
# power-of-two group scales (Quant.PER_TOKEN_GROUP_128_UE8M0; call the op): model code writes
# them torch.pow(2, torch.ceil(torch.log2(scale))), whose fp32 log2 rounds a scale just above a
# power of two down onto it (2^-9 * (1 + 2^-23) gives -9.0), where the op rounds up exactly.

FUSED_NORM_FP8 = torch.ops.tpfuse.allreduce_add_rmsnorm_fp8.default
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0


def quant_fp8_static(n, scale):
    """q = e4m3(n / scale), the scale a float32 tensor of one element."""
    return (n.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)


def quant_fp8_per_token(n):
    """(q, scale [..., 1]): each token's scale max(amax, 1e-10) / 448."""
    nf = n.float()
    scale = nf.abs().amax(-1, keepdim=True).clamp(min=QUANT_MIN_AMAX) / _FP8_MAX
    return (nf / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale


def quant_fp8_group(n):
    """(q, scale [..., hidden / 128, 1]): a scale per token and group of 128 along hidden."""
    nf = n.float().reshape(*n.shape[:-1], n.shape[-1] // QUANT_GROUP_SIZE, QUANT_GROUP_SIZE)
    scale = nf.abs().amax(-1, keepdim=True).clamp(min=QUANT_MIN_AMAX) / _FP8_MAX
    q = (nf / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).reshape(n.shape)
    return q, scale


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# The fused ops the FP8 stage extends, and the form with the FP8 output of each.
_FP8_FORM = {
    FUSED_NORM: FUSED_NORM_FP8,
    torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm.default:
        torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm_fp8.default,
}


def _node_before(first: torch.fx.Node, second: torch.fx.Node) -> bool:
    """Whether `first` comes before `second` in their graph."""
    if first.op in ("placeholder", "get_attr"):
        return True
    for node in first.graph.nodes:
        if node is first:
            return True
        if node is second:
            return False
    return False


class NormQuantFp8(FusedPattern):
    """The FP8 quantization (above) of a fused add + RMSNorm's norm output, possibly viewed to
    other token dims, -> that op with the FP8 output: the op is retargeted to
    allreduce_add_rmsnorm_fp8 in place (its norm and residual outputs, and their other users,
    stay) and the quantization's outputs become views of its quant_out and scales."""

    # quant: tpfuse.Quant's value; the stat counts the sites by the bench's op names.
    modes = {
        "static": (quant_fp8_static, int(Quant.STATIC), "allreduce_add_rmsnorm_fp8"),
        "per_token": (quant_fp8_per_token, int(Quant.PER_TOKEN),
                      "allreduce_add_rmsnorm_fp8_token"),
        "group128": (quant_fp8_group, int(Quant.PER_TOKEN_GROUP_128),
                     "allreduce_add_rmsnorm_fp8_group128"),
    }

    def __init__(self, fusion, mode: str):
        super().__init__(fusion)
        self.mode = mode
        self.quantize, self.quant, self.stat = self.modes[mode]
        self.argnames = ["n", "scale"] if mode == "static" else ["n"]

    def example_inputs(self):
        specs = [((5, 2 * QUANT_GROUP_SIZE), torch.bfloat16)]
        if self.mode == "static":
            specs.append(((1,), torch.float32))
        return _fake_inputs(*specs)

    def register(self, patterns: PatternMatcherPass) -> None:
        generic = gen_pattern(self.quantize, self.example_inputs(), _trace)
        register_graph_pattern(generic, extra_check=self.check, pass_dict=patterns)(self.rewrite)

    @staticmethod
    def norm_op_of(n: torch.fx.Node) -> Optional[torch.fx.Node]:
        """The fused add + RMSNorm (without FP8 output; plain or with the MoE finalize) whose norm
        output `n` is, through views."""
        while isinstance(n, torch.fx.Node) and n.target in _VIEWS:
            n = n.args[0]
        if not isinstance(n, torch.fx.Node) or n.target is not operator.getitem:
            return None
        op, index = n.args
        if index != 0 or not isinstance(op, torch.fx.Node) or op.target not in _FP8_FORM:
            return None
        return op

    def fits(self, match: Match) -> Optional[torch.fx.Node]:
        """The op to retarget, when the match is the quantization at its own sizes and fits it."""
        kwargs = match.kwargs
        op = self.norm_op_of(kwargs["n"])
        if op is None:
            return None
        values = [kwargs[name].meta.get("val") for name in self.argnames]
        if any(value is None for value in values):
            return None
        n = values[0]
        hidden = n.shape[-1] if n.dim() >= 1 else None
        if n.dtype not in (torch.bfloat16, torch.float16) or not isinstance(hidden, int):
            return None
        if self.mode == "group128" and hidden % QUANT_GROUP_SIZE:
            return None
        if self.mode == "static":
            scale = values[1]
            if scale.dtype != torch.float32 or scale.numel() != 1:
                return None
            if not _node_before(kwargs["scale"], op):  # the op moves nowhere: it must see it
                return None
        # What register_replacement does for its patterns: the pattern again at these sizes,
        # with no constant ignored.
        specific = _specific_pattern(self.quantize, values, self.argnames)
        if not is_match(specific.match(match.output_nodes()[0])):
            return None
        return op

    def check(self, match):
        return self.fits(match) is not None

    @staticmethod
    def _unread_views_erased(node: torch.fx.Node) -> bool:
        """Erases `node` and the views below it where nothing else reads them; whether it went."""
        for user in list(node.users):
            if user.target in _VIEWS:
                NormQuantFp8._unread_views_erased(user)
        if node.users:
            return False
        node.graph.erase_node(node)
        return True

    @staticmethod
    def _retarget(op: torch.fx.Node, target, values: Dict[str, Any]) -> None:
        """`op` calls `target` with `values` by name (the schema's defaults elsewhere)."""
        new_args = tuple(values[a.name] if a.name in values else a.default_value
                         for a in target._schema.arguments)
        with torch._dynamo.utils.detect_fake_mode([op.meta["val"][0]]):
            fake = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in new_args]
            value = target(*fake)
        op.target, op.args, op.kwargs = target, new_args, {}
        op.meta["val"] = value
        if "eager_input_vals" in op.meta:  # what Inductor holds the op's layouts to
            op.meta["eager_input_vals"] = (tuple(fake), {})
        for user in op.users:
            if user.target is operator.getitem:
                user.meta["val"] = value[user.args[1]]

    def rewrite(self, match: Match, *args, **kwargs) -> None:
        op = self.fits(match)
        target = _FP8_FORM[op.target]
        # The op's own arguments by name, and the FP8 output's, in the FP8 form's order.
        values = dict(op_arguments(op), quant=self.quant, column_major_scales=False,
                      scale=kwargs["scale"] if self.mode == "static" else None)
        self._retarget(op, target, values)
        value = op.meta["val"]
        graph = op.graph
        outputs = []
        with graph.inserting_after(op):
            for index in (3, 2):
                item = graph.call_function(operator.getitem, (op, index))
                item.meta["val"] = value[index]
                outputs.insert(0, item)
        quant_out, scales = outputs

        def views(quant_out, scales, n):
            q = quant_out.view(n.shape)
            if self.mode == "static":
                return q
            groups = n.shape[-1] // QUANT_GROUP_SIZE if self.mode == "group128" else 1
            lead = n.shape[:-1] if self.mode == "per_token" else (*n.shape[:-1], groups)
            return q, scales.view(*lead, 1)

        match.replace_by_example(views, [quant_out, scales, kwargs["n"]])
        for item in outputs:
            if not item.users:
                graph.erase_node(item)
        # The bf16 norm (the op's first output) stays where something besides the quantization
        # reads it (a MoE router, say, or a size taken from it under dynamic shapes); otherwise
        # the op writes the FP8 output alone (keep_norm=False: no bf16 norm written).
        norms = [user for user in op.users
                 if user.target is operator.getitem and user.args[1] == 0]
        if all([self._unread_views_erased(norm) for norm in norms]):
            values["keep_norm"] = False
            self._retarget(op, target, values)
        if self.mode == "group128":
            self._fold_column_major(op, target, values)
        self.fusion.stats[self.stat] += 1

    @staticmethod
    def _fold_column_major(op: torch.fx.Node, target, values: Dict[str, Any]) -> None:
        """Group scales read only as a column-major copy, `s.t().contiguous().t()` of their
        [tokens, groups] form (as torch's block-scaled FP8 GEMM and CUTLASS's take activation
        scales): the op writes them column-major (column_major_scales) and the copy goes."""
        (scales,) = [user for user in op.users
                     if user.target is operator.getitem and user.args[1] == 3]
        shape = tuple(scales.meta["val"].shape)
        chain, node = [], scales
        while len(node.users) == 1:
            (user,) = node.users
            if user.target not in _VIEWS + (aten.squeeze.dim, aten.squeeze.dims):
                break
            chain.append(user)
            node = user
        # The [tokens, groups] view, transposed, made contiguous, transposed back.
        steps = []
        for want in (aten.permute.default, aten.clone.default, aten.permute.default):
            if len(node.users) != 1:
                return
            (node,) = node.users
            if node.target is not want:
                return
            steps.append(node)
        first, clone, last = steps
        transposed = [1, 0]
        if (tuple(first.args[0].meta["val"].shape) != shape or list(first.args[1]) != transposed
                or list(last.args[1]) != transposed
                or clone.kwargs.get("memory_format") is not torch.contiguous_format):
            return
        values["column_major_scales"] = True
        NormQuantFp8._retarget(op, target, values)
        last.replace_all_uses_with(scales)
        for node in reversed(chain + steps):
            node.graph.erase_node(node)


def _ops_of(graph: torch.fx.Graph) -> List[str]:
    return [str(node.target) for node in graph.nodes if node.op == "call_function"]


def _tpfuse_calls(graph: torch.fx.Graph) -> List[Dict[str, Any]]:
    """Each tpfuse op of the graph with its scalar arguments by name."""
    calls = []
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("tpfuse."):
            scalars = {name: value for name, value in op_arguments(node).items()
                       if not isinstance(value, torch.fx.Node) and name != "team"}
            calls.append({"op": str(node.target), **scalars})
    return calls


class TpfusePass(CustomGraphPass):
    """The passes for one team over one process group (default: the world).

    `stats` counts rewrites per fused op since construction; `graphs` keeps, per compiled graph,
    the ops before and after and the tpfuse calls with their scalar arguments. Callable on an FX
    graph, for a pass manager that runs its own list (e.g. vLLM's post-grad pass manager, which
    owns Inductor's post_grad_custom_post_pass hook: add this object to it instead of install())."""

    def __init__(self, team: Team, group: Optional["torch.distributed.ProcessGroup"] = None):
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        self.team = team.handle
        self.world_size = team.world_size
        self.group_name = group.group_name
        self.stats: Dict[str, int] = {
            "allreduce_add_rmsnorm": 0, "allreduce_qk_rmsnorm": 0, "allreduce_qk_rmsnorm_rope": 0,
            "allreduce_moe_finalize_add_rmsnorm": 0,
            **{stat: 0 for _, _, stat in NormQuantFp8.modes.values()},
        }
        self.graphs: List[Dict[str, Any]] = []
        norm_forms = list(NORM_FORMS)
        # The MoE combine first: where it precedes the all-reduce, the plain patterns match too.
        self.patterns: List[FusedPattern] = [
            *(MoeFinalizeAddRMSNorm(self, form, first, combine)
              for form in ("weight_first", "weight_last", "functional")
              for first in (False, True) for combine in MOE_COMBINE_FORMS),
            *(AllReduceAddRMSNorm(self, form, first, reshaped) for form in norm_forms
              for first in (False, True) for reshaped in (False, True)),
            *(AllReduceRMSNorm(self, form) for form in norm_forms),
            QkNormSingleSplit(self, returns_v=True), QkNormSingleSplit(self, returns_v=False),
            QkNormSlices(self),
        ]
        self.rope_patterns: List[FusedPattern] = [QkNormRope(self)]
        self.quant_patterns: List[FusedPattern] = [NormQuantFp8(self, mode)
                                                   for mode in NormQuantFp8.modes]
        self.stages = [PatternMatcherPass(pass_name="tpfuse_allreduce_norms"),
                       PatternMatcherPass(pass_name="tpfuse_qk_rope"),
                       PatternMatcherPass(pass_name="tpfuse_norm_quant")]
        stage_patterns = (self.patterns, self.rope_patterns, self.quant_patterns)
        for stage, patterns in zip(self.stages, stage_patterns):
            for pattern in patterns:
                pattern.register(stage)

    def fused_kernel_runs(self, x) -> bool:
        """False when the token count is fixed at compile time and the team would run it through
        its NCCL path anyway (more than its workspace carries, or more than its selection table
        gives a fused kernel): that graph is left unfused."""
        hidden, numel = x.shape[-1], x.numel()
        # A SymInt is not an int: asking it for a value would specialize the compiled graph.
        if not isinstance(hidden, int) or not isinstance(numel, int) or hidden <= 0 or numel <= 0:
            return True
        return torch.ops.tpfuse.choose(self.team, numel // hidden, hidden, x.dtype) != "nccl"

    def fused_add_rmsnorm(self, x, residual, gamma, eps, norm_weight: int):
        hidden = x.shape[-1]
        rows = residual.reshape(-1, hidden) if residual is not None else None
        # norm_weight only when it is not the default, so builds without it take the plain form.
        extra = {"norm_weight": norm_weight} if norm_weight else {}
        norm, residual_out = FUSED_NORM(
            self.team, x.reshape(-1, hidden), rows, gamma, eps, algorithm=int(Algorithm.AUTO),
            **extra
        )
        return norm.view(x.shape), residual_out.view(x.shape)

    def __call__(self, graph: torch.fx.Graph) -> None:
        before = _ops_of(graph)
        for stage in self.stages:
            originals = _last_dim_as_minus_one(graph)
            stage.apply(graph)
            graph.eliminate_dead_code()
            for node, args in originals.items():
                if not node._erased:
                    node.args = args
        self.graphs.append(
            {"before": before, "after": _ops_of(graph), "tpfuse_calls": _tpfuse_calls(graph)}
        )

    def uuid(self) -> Optional[bytes]:
        # The team handle is baked into the rewritten graph and means something in this process
        # only: Inductor's caches must not hand the graph to another process.
        key = (os.getpid(), self.team, self.group_name, self.world_size)
        return hashlib.sha256(b"tpfuse.passes/3" + repr(key).encode()).digest()


def make_pass(team: Team, group: Optional["torch.distributed.ProcessGroup"] = None) -> TpfusePass:
    """The pass for `team` over `group` (default: the world), not installed anywhere."""
    return TpfusePass(team, group)


def install(team: Team, group: Optional["torch.distributed.ProcessGroup"] = None) -> TpfusePass:
    """Rewrites, in graphs compiled from now on, the patterns above over `group` (default: the
    world) into tpfuse ops on `team`: sets Inductor's post_grad_custom_post_pass (replacing
    whatever was there) to a new pass, and returns it."""
    fusion = make_pass(team, group)
    inductor_config.post_grad_custom_post_pass = fusion
    return fusion


def uninstall() -> None:
    inductor_config.post_grad_custom_post_pass = None
