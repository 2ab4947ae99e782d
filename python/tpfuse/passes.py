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
Token counts the workspace cannot carry still run: the op itself takes the NCCL path then.

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
stats: Dict[str, int] = {"allreduce_add_rmsnorm": 0}
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
    return isinstance(kwargs["eps"], (int, float))


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
    return patterns


class _Pass(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        before = _ops_of(graph)
        _patterns().apply(graph)
        graph.eliminate_dead_code()
        graphs.append({"before": before, "after": _ops_of(graph)})

    def uuid(self) -> Optional[bytes]:
        # The team handles are baked into the rewritten graph and mean something in this process
        # only: Inductor's caches must not hand the graph to another process.
        key = repr((os.getpid(), sorted(_teams.items()))).encode()
        return hashlib.sha256(b"tpfuse.passes/1" + key).digest()


def install(team: Team, group: Optional["torch.distributed.ProcessGroup"] = None) -> None:
    """Rewrites, in graphs compiled from now on, all-reduces over `group` (default: the world)
    followed by add + RMSNorm into tpfuse ops on `team`."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    _teams[group.group_name] = team.handle
    inductor_config.post_grad_custom_post_pass = _Pass()


def uninstall() -> None:
    _teams.clear()
    inductor_config.post_grad_custom_post_pass = None
