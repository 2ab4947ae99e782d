"""torch.compile (Inductor) passes that rewrite unfused graphs into tpfuse's fused ops.

    import tpfuse, tpfuse.passes
    team = tpfuse.Team.from_group(group)
    tpfuse.passes.install(team, group)        # before torch.compile runs
    model = torch.compile(model)

Pattern (this module, post-grad): an all-reduce as torch.compile emits it (functional
``all_reduce`` + ``wait_tensor`` on the installed group), an optional residual add, and RMSNorm in
either form models write it -- the hand-written fp32-upcast one (``h.float()``, ``pow(2).mean(-1)``,
``rsqrt(var + eps)``, back to the input dtype, times the weight, in either order) or
``torch.nn.functional.rms_norm`` -- with any eps and any width, becomes one
``tpfuse::allreduce_add_rmsnorm`` call whose two outputs replace the norm and the residual stream.
A token count fixed at compile time for which the team would take its NCCL path anyway (more than
its workspace carries, or more than its selection table gives a fused kernel) keeps the unfused
graph; a symbolic (dynamic) count is rewritten, and the op chooses at run time.

And MiniMax-M2's QK norm as a TP engine writes it (per-rank mean squares of q and k, one
all-reduce of both concatenated, divided by the world size, normalized, weighted, back to the
input dtype; q and k split from one packed qkv) becomes one ``tpfuse::allreduce_qk_rmsnorm``; a
rotate-half partial rotary embedding applied to its q and k as engines write it natively (vLLM's
``RotaryEmbedding.forward_native``) is then folded into that op (a second stage, below).

Numerics: the fused op sums in fp32 and rounds once, so its outputs can differ from the unfused
graph's (which rounds the all-reduce, then the add) in the last bits.

``stats`` counts the rewrites of the last compiled graphs; ``graphs`` keeps, per compiled graph,
the ops it held before and after the pass (for tests and for checking a deployment).
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Dict, List, Optional

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    MultiOutputPattern,
    PatternMatcherPass,
    register_graph_pattern,
)

from .team import Team

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

# Installed groups: c10d group name -> team handle.
_teams: Dict[str, int] = {}
stats: Dict[str, int] = {
    "allreduce_add_rmsnorm": 0, "allreduce_qk_rmsnorm": 0, "allreduce_qk_rmsnorm_rope": 0,
}
_world_sizes: Dict[str, int] = {}
graphs: List[Dict[str, List[str]]] = []


def _ops_of(graph: torch.fx.Graph) -> List[str]:
    return [str(node.target) for node in graph.nodes if node.op == "call_function"]


def _norm_patterns(h, upcast_users: int):
    """The RMSNorm forms over the (multi-user) tensor `h`, each a pattern of the final output."""
    hf = CallFunction(prims.convert_element_type.default, h, torch.float32, _users=upcast_users)
    variance = CallFunction(
        aten.mean.dim, CallFunction(aten.pow.Tensor_Scalar, hf, 2), KeywordArg("dims"), True
    )
    rstd = CallFunction(
        aten.rsqrt.default,
        CallFunction([aten.add.Tensor, aten.add.Scalar], variance, KeywordArg("eps")),
    )
    normed = CallFunction(aten.mul.Tensor, hf, rstd)
    back = CallFunction(prims.convert_element_type.default, normed, KeywordArg("dtype"))
    return [
        # hand-written: weight * h.to(dtype), or h.to(dtype) * weight
        CallFunction(aten.mul.Tensor, KeywordArg("weight"), back),
        CallFunction(aten.mul.Tensor, back, KeywordArg("weight")),
        # torch.nn.functional.rms_norm: the weight in fp32, then one rounding
        CallFunction(
            prims.convert_element_type.default,
            CallFunction(aten.mul.Tensor, normed, KeywordArg("weight")),
            KeywordArg("dtype"),
        ),
    ]


def _check(match: Match) -> bool:
    kwargs = match.kwargs
    if kwargs.get("group") not in _teams or kwargs.get("op") != "sum":
        return False
    x = kwargs["x"].meta.get("val")
    weight = kwargs["weight"].meta.get("val")
    if x is None or weight is None or x.dim() < 1:
        return False
    dims = [int(d) for d in kwargs["dims"]]
    if dims not in ([-1], [x.dim() - 1]):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or kwargs["dtype"] != x.dtype:
        return False
    if weight.dtype != x.dtype or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return False
    residual = kwargs.get("residual")
    if residual is not None:
        value = residual.meta.get("val")
        if value is None or value.dtype != x.dtype or value.shape != x.shape:
            return False
    if not isinstance(kwargs["eps"], (int, float)):
        return False
    return _fused_kernel_runs(kwargs["group"], x)


def _fused_kernel_runs(group: str, x) -> bool:
    """False when the token count is fixed at compile time and the team would run it through its
    NCCL path anyway (more than its workspace carries, or more than its selection table gives a
    fused kernel): that graph is left unfused. A symbolic token count is rewritten; the op
    chooses at run time."""
    hidden, numel = x.shape[-1], x.numel()
    # A SymInt is not an int: asking it for a value would specialize the compiled graph.
    if not isinstance(hidden, int) or not isinstance(numel, int) or hidden <= 0 or numel <= 0:
        return True
    tokens = numel // hidden
    algorithm = torch.ops.tpfuse.choose(_teams[group], tokens, hidden, x.dtype)
    return algorithm != "nccl"


def _rewrite(match: Match, *args, **kwargs) -> None:
    handle = _teams[kwargs["group"]]
    eps = float(kwargs["eps"])
    has_residual = "residual" in kwargs

    def replacement(x, residual, weight):
        hidden = x.shape[-1]
        norm, residual_out = torch.ops.tpfuse.allreduce_add_rmsnorm.default(
            handle,
            x.reshape(-1, hidden),
            residual.reshape(-1, hidden) if residual is not None else None,
            weight,
            eps,
            0,
        )
        return norm.view(x.shape), residual_out.view(x.shape)

    if has_residual:
        match.replace_by_example(replacement, [kwargs["x"], kwargs["residual"], kwargs["weight"]])
    else:
        match.replace_by_example(
            lambda x, weight: replacement(x, None, weight), [kwargs["x"], kwargs["weight"]]
        )
    stats["allreduce_add_rmsnorm"] += 1


@functools.lru_cache(None)
def _patterns() -> PatternMatcherPass:
    patterns = PatternMatcherPass(pass_name="tpfuse_allreduce_add_rmsnorm")
    reduced = CallFunction(
        c10d.wait_tensor.default,
        CallFunction(c10d.all_reduce.default, KeywordArg("x"), KeywordArg("op"), KeywordArg("group")),
    )
    sums = [
        CallFunction(aten.add.Tensor, reduced, KeywordArg("residual"), _users=2),
        CallFunction(aten.add.Tensor, KeywordArg("residual"), reduced, _users=2),
    ]
    for h in sums:
        for norm in _norm_patterns(h, upcast_users=2):
            register_graph_pattern(
                MultiOutputPattern([norm, h]), extra_check=_check, pass_dict=patterns
            )(_rewrite)
    # Without a residual: the all-reduced sum itself is normalized (and may be used elsewhere).
    plain = CallFunction(
        c10d.wait_tensor.default,
        CallFunction(c10d.all_reduce.default, KeywordArg("x"), KeywordArg("op"), KeywordArg("group")),
        _users=2,
    )
    for norm in _norm_patterns(plain, upcast_users=2):
        register_graph_pattern(
            MultiOutputPattern([norm, plain]), extra_check=_check, pass_dict=patterns
        )(_rewrite)
    _register_qk(patterns)
    return patterns


# --- MiniMax-M2's QK norm: per-rank mean squares of q and k, one all-reduce of both (cat'd),
# divided by the world size, normalized, weighted, back to the input dtype. q and k are either
# getitems 0 and 1 of qkv.split([q_size, kv_size, kv_size], -1) (single split) or last-dim
# slices of qkv (separate splits).


def _last_dim(dims, ndim: int) -> bool:
    dims = [int(d) for d in dims] if isinstance(dims, (list, tuple)) else [int(dims)]
    return dims in ([-1], [ndim - 1])


def _qkv_source(q: torch.fx.Node, k: torch.fx.Node):
    """(qkv node, q_size, kv_size) when q and k are the first two parts of one packed qkv."""
    import operator

    if q.target is operator.getitem and k.target is operator.getitem:
        split = q.args[0]
        if (
            split is k.args[0]
            and q.args[1] == 0
            and k.args[1] == 1
            and split.target == aten.split_with_sizes.default
        ):
            qkv, sizes = split.args[0], list(split.args[1])
            dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            value = qkv.meta.get("val")
            if (
                value is not None
                and len(sizes) == 3
                and sizes[1] == sizes[2]
                and _last_dim(dim, value.dim())
            ):
                return qkv, int(sizes[0]), int(sizes[1])
        return None
    if q.target == aten.slice.Tensor and k.target == aten.slice.Tensor:
        qkv = q.args[0]
        value = qkv.meta.get("val")
        if value is None or k.args[0] is not qkv:
            return None
        q_dim, q_start, q_end = (list(q.args[1:4]) + [None] * 3)[:3]
        k_dim, k_start, k_end = (list(k.args[1:4]) + [None] * 3)[:3]
        if not (_last_dim(q_dim, value.dim()) and _last_dim(k_dim, value.dim())):
            return None
        width = value.shape[-1]
        if q_start not in (0, None) or q_end is None or k_start != q_end or k_end is None:
            return None
        q_size, kv_size = int(q_end), int(k_end) - int(q_end)
        if q_size + 2 * kv_size != width:
            return None
        return qkv, q_size, kv_size
    return None


def _check_qk(match: Match) -> bool:
    kwargs = match.kwargs
    group = kwargs.get("group")
    if group not in _teams or kwargs.get("op") != "sum":
        return False
    if kwargs["world"] != _world_sizes[group] or kwargs["eps_q"] != kwargs["eps_k"]:
        return False
    source = _qkv_source(kwargs["q"], kwargs["k"])
    if source is None:
        return False
    qkv, q_size, kv_size = source
    value = qkv.meta["val"]
    if value.dtype not in (torch.bfloat16, torch.float16) or not value.is_contiguous():
        return False
    if kwargs["dtype_q"] != value.dtype or kwargs["dtype_k"] != value.dtype:
        return False
    for dims in (kwargs["q_dims"], kwargs["k_dims"], kwargs["cat_dim"], kwargs["split_dim"]):
        if not _last_dim(dims, value.dim()):
            return False
    for name, size in (("q_weight", q_size), ("k_weight", kv_size)):
        weight = kwargs[name].meta.get("val")
        if weight is None or weight.dtype != value.dtype or tuple(weight.shape) != (size,):
            return False
    return True


def _rewrite_qk(match: Match, *args, **kwargs) -> None:
    group = kwargs["group"]
    handle, world = _teams[group], _world_sizes[group]
    qkv, q_size, kv_size = _qkv_source(kwargs["q"], kwargs["k"])
    eps = float(kwargs["eps_q"])

    def replacement(qkv, q_weight, k_weight):
        rows = qkv.reshape(-1, qkv.shape[-1])
        # Mean squares over ranks / world == sums over ranks / (width * world): the op's form.
        q, k = torch.ops.tpfuse.allreduce_qk_rmsnorm.default(
            handle, rows, q_weight, k_weight, q_size, kv_size, q_size * world, kv_size * world,
            1, eps, None, None, 0, 0, 0, 0,
        )
        return q.view(*qkv.shape[:-1], q_size), k.view(*qkv.shape[:-1], kv_size)

    match.replace_by_example(replacement, [qkv, kwargs["q_weight"], kwargs["k_weight"]])
    stats["allreduce_qk_rmsnorm"] += 1


def _register_qk(patterns: PatternMatcherPass) -> None:
    import operator

    def mean_square(upcast, dims):
        return CallFunction(
            aten.mean.dim, CallFunction(aten.pow.Tensor_Scalar, upcast, 2), KeywordArg(dims), True
        )

    qf = CallFunction(prims.convert_element_type.default, KeywordArg("q"), torch.float32, _users=2)
    kf = CallFunction(prims.convert_element_type.default, KeywordArg("k"), torch.float32, _users=2)
    both = CallFunction(
        aten.cat.default, [mean_square(qf, "q_dims"), mean_square(kf, "k_dims")],
        KeywordArg("cat_dim"),
    )
    reduced = CallFunction(
        c10d.wait_tensor.default,
        CallFunction(c10d.all_reduce.default, both, KeywordArg("op"), KeywordArg("group")),
    )
    variances = CallFunction(
        aten.split.Tensor,
        CallFunction(aten.div.Tensor, reduced, KeywordArg("world")),
        1,
        KeywordArg("split_dim"),
        _users=2,
    )

    def normalized(upcast, index, eps, weight, dtype):
        rstd = CallFunction(
            aten.rsqrt.default,
            CallFunction(
                [aten.add.Tensor, aten.add.Scalar],
                CallFunction(operator.getitem, variances, index),
                KeywordArg(eps),
            ),
        )
        return CallFunction(
            prims.convert_element_type.default,
            CallFunction(
                aten.mul.Tensor, CallFunction(aten.mul.Tensor, upcast, rstd), KeywordArg(weight)
            ),
            KeywordArg(dtype),
        )

    pattern = MultiOutputPattern(
        [
            normalized(qf, 0, "eps_q", "q_weight", "dtype_q"),
            normalized(kf, 1, "eps_k", "k_weight", "dtype_k"),
        ]
    )
    register_graph_pattern(pattern, extra_check=_check_qk, pass_dict=patterns)(_rewrite_qk)


# --- RoPE after the QK norm, folded into the fused op (a second stage, on graphs the QK pattern
# has rewritten): the rotate-half (neox) partial rotary embedding as engines write it natively
# (vLLM's RotaryEmbedding.forward_native): cos_sin = cache[positions]; cos, sin = chunk(2);
# per tensor x of [tokens, heads * head_dim]: view [tokens, -1, head_dim], x[..., :rotary_dim]
# split in halves x1, x2; cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), cat with
# x[..., rotary_dim:], back to [tokens, width]; cos and sin unsqueezed at -2 and cast to x's
# dtype. The fused op applies it in fp32 before its single rounding. Not matched (left unfused):
# the interleaved style, full-width rotary (rotary_dim == head_dim), a cache that is not fp32
# [positions, rotary_dim], tokens not flattened to 2-D.


def _qk_op_of(op: torch.fx.Node):
    """`op` when it is the tpfuse QK norm run without RoPE whose only users are its two outputs'
    getitems (each of which the RoPE chain is the only user of); else None."""
    if op.op != "call_function" or op.target != torch.ops.tpfuse.allreduce_qk_rmsnorm.default:
        return None
    if len(op.users) != 2 or any(len(user.users) != 1 for user in op.users):
        return None
    return op if _op_arg(op, 14, "rope_style", 0) == 0 else None


def _op_arg(node: torch.fx.Node, index: int, name: str, default):
    """Argument `index` (schema name `name`) of a call, which the graph may leave at its default."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _cos_sin_source(kwargs, rotary_dim: int):
    """(positions, cache) when cos and sin are the halves of an fp32 [positions, rotary_dim]
    cache's rows at int64 [tokens] positions."""
    if kwargs["cos_sin_half"] != rotary_dim // 2 or kwargs["cos_sin_dim"] not in (-1, 1):
        return None
    cache, positions = kwargs["cache"], kwargs["positions"]
    cache_value, positions_value = cache.meta.get("val"), positions.meta.get("val")
    if cache_value is None or positions_value is None:
        return None
    if cache_value.dtype != torch.float32 or cache_value.dim() != 2:
        return None
    if cache_value.shape[1] != rotary_dim or not cache_value.is_contiguous():
        return None
    if positions_value.dtype != torch.int64 or positions_value.dim() != 1:
        return None
    return positions, cache


def _rope_geometry(kwargs, prefix: str, width: int):
    """(head_dim, rotary_dim) of one tensor's RoPE chain, or None."""
    heads_shape = kwargs[prefix + "_heads_shape"]
    if not isinstance(heads_shape, (list, tuple)) or len(heads_shape) != 3:
        return None
    head_dim, rotary_dim = heads_shape[2], kwargs[prefix + "_rotary_dim"]
    if not isinstance(head_dim, int) or not isinstance(rotary_dim, int):
        return None
    if width % head_dim != 0 or not 0 < rotary_dim < head_dim or rotary_dim % 2 != 0:
        return None
    if kwargs[prefix + "_half"] != rotary_dim // 2 or kwargs[prefix + "_pass_start"] != rotary_dim:
        return None
    if not isinstance(kwargs[prefix + "_pass_end"], int) or kwargs[prefix + "_pass_end"] < head_dim:
        return None
    for name in ("_slice_dim", "_split_dim", "_cat_dim", "_pass_dim", "_join_dim"):
        if kwargs[prefix + name] not in (-1, 2):
            return None
    return head_dim, rotary_dim


def _check_rope(match: Match) -> bool:
    kwargs = match.kwargs
    op = _qk_op_of(kwargs["qk_op"])
    if op is None:
        return False
    q, k = (user.meta.get("val") for user in sorted(op.users, key=lambda user: user.args[1]))
    if q is None or k is None or q.dim() != 2 or k.dim() != 2:
        return False
    q_geometry = _rope_geometry(kwargs, "q", q.shape[1])
    if q_geometry is None or _rope_geometry(kwargs, "k", k.shape[1]) != q_geometry:
        return False
    if any(kwargs[name] != q.dtype for name in ("q_cos_dtype", "q_sin_dtype", "k_cos_dtype",
                                                  "k_sin_dtype")):
        return False
    source = _cos_sin_source(kwargs, q_geometry[1])
    return source is not None and source[0].meta["val"].shape[0] == q.shape[0]


def _rewrite_rope(match: Match, *args, **kwargs) -> None:
    op = kwargs["qk_op"]
    head_dim, rotary_dim = _rope_geometry(kwargs, "q", int(_op_arg(op, 4, "q_size", 0)))
    positions, cache = _cos_sin_source(kwargs, rotary_dim)
    a = list(op.args[:10])
    algorithm = _op_arg(op, 15, "algorithm", 0)

    def replacement(rows, q_weight, k_weight, positions, cache):
        return torch.ops.tpfuse.allreduce_qk_rmsnorm.default(
            a[0], rows, q_weight, k_weight, a[4], a[5], a[6], a[7], a[8], a[9], positions, cache,
            head_dim, rotary_dim, 1, algorithm,
        )

    match.replace_by_example(replacement, [op.args[1], op.args[2], op.args[3], positions, cache])
    stats["allreduce_qk_rmsnorm_rope"] += 1


def _register_rope(patterns: PatternMatcherPass) -> None:
    import operator

    # cos and sin: the halves of cache[positions], each used by the q and the k chain (the shared
    # nodes anchor the two outputs of the pattern).
    halves_of_row = CallFunction(
        aten.split.Tensor,
        CallFunction(aten.index.Tensor, KeywordArg("cache"), [KeywordArg("positions")]),
        KeywordArg("cos_sin_half"),
        KeywordArg("cos_sin_dim"),
        _users=2,
    )
    cos_half = CallFunction(operator.getitem, halves_of_row, 0, _users=2)
    sin_half = CallFunction(operator.getitem, halves_of_row, 1, _users=2)

    def chain(prefix: str):
        def arg(name):
            return KeywordArg(prefix + name)

        # x: output 0 (q) or 1 (k) of the fused QK norm, used by this chain only.
        x = CallFunction(operator.getitem, KeywordArg("qk_op"), 0 if prefix == "q" else 1)
        heads = CallFunction(aten.reshape.default, x, arg("_heads_shape"), _users=2)
        rotated = CallFunction(aten.slice.Tensor, heads, arg("_slice_dim"), 0, arg("_rotary_dim"))
        halves = CallFunction(aten.split.Tensor, rotated, arg("_half"), arg("_split_dim"), _users=2)
        x1 = CallFunction(operator.getitem, halves, 0, _users=2)
        x2 = CallFunction(operator.getitem, halves, 1, _users=2)

        def trig(half, name):
            return CallFunction(
                prims.convert_element_type.default,
                CallFunction(aten.unsqueeze.default, half, -2),
                arg("_" + name + "_dtype"),
                _users=2,
            )

        cos, sin = trig(cos_half, "cos"), trig(sin_half, "sin")
        first = CallFunction(
            aten.sub.Tensor, CallFunction(aten.mul.Tensor, x1, cos),
            CallFunction(aten.mul.Tensor, x2, sin),
        )
        second = CallFunction(
            aten.add.Tensor, CallFunction(aten.mul.Tensor, x2, cos),
            CallFunction(aten.mul.Tensor, x1, sin),
        )
        joined = CallFunction(aten.cat.default, [first, second], arg("_cat_dim"))
        passed = CallFunction(
            aten.slice.Tensor, heads, arg("_pass_dim"), arg("_pass_start"), arg("_pass_end")
        )
        return CallFunction(
            aten.reshape.default,
            CallFunction(aten.cat.default, [joined, passed], arg("_join_dim")),
            arg("_out_shape"),
        )

    pattern = MultiOutputPattern([chain("q"), chain("k")])
    register_graph_pattern(pattern, extra_check=_check_rope, pass_dict=patterns)(_rewrite_rope)


@functools.lru_cache(None)
def _rope_patterns() -> PatternMatcherPass:
    patterns = PatternMatcherPass(pass_name="tpfuse_qk_rope")
    _register_rope(patterns)
    return patterns


class _Pass(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        before = _ops_of(graph)
        _patterns().apply(graph)
        graph.eliminate_dead_code()
        _rope_patterns().apply(graph)
        graph.eliminate_dead_code()
        graphs.append({"before": before, "after": _ops_of(graph)})

    def uuid(self) -> Optional[bytes]:
        # The team handles are baked into the rewritten graph and mean something in this process
        # only: Inductor's caches must not hand the graph to another process.
        key = repr((os.getpid(), sorted(_teams.items()))).encode()
        return hashlib.sha256(b"tpfuse.passes/1" + key).digest()


def make_pass(team: Team, group: Optional["torch.distributed.ProcessGroup"] = None) -> CustomGraphPass:
    """The pass for `team` over `group` (default: the world), as a callable on an FX graph, for a
    pass manager that runs its own list (e.g. vLLM's post-grad pass manager, which already owns
    Inductor's post_grad_custom_post_pass hook: add this object to it instead of install())."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    _teams[group.group_name] = team.handle
    _world_sizes[group.group_name] = team.world_size
    return _Pass()


def install(team: Team, group: Optional["torch.distributed.ProcessGroup"] = None) -> None:
    """Rewrites, in graphs compiled from now on, all-reduces over `group` (default: the world)
    followed by add + RMSNorm, and the QK norm, into tpfuse ops on `team`: sets Inductor's
    post_grad_custom_post_pass (replacing whatever was there)."""
    inductor_config.post_grad_custom_post_pass = make_pass(team, group)


def uninstall() -> None:
    _teams.clear()
    _world_sizes.clear()
    inductor_config.post_grad_custom_post_pass = None
