"""The fused ops, as thin calls of the C++-registered torch ops.

Each op is declared once, in the library (src/torch/ops.cc), and each wrapper here is made from
that declaration: its schema (``torch.ops.tpfuse.<op>.default._schema``: the arguments, their
defaults) and ``torch.ops.tpfuse.describe()`` (the order of the Python parameters, each enum
argument's enum and the values it takes). The enums and the FP8 constants are the library's too
(include/tpfuse). Written here is only what is Python's own: the documentation, a team given as a
``Team`` (and the check that an in-process CPU team has a thread per rank), enums given by name,
and ``allreduce_moe_finalize_add_rmsnorm``'s choice of op by ``quant``. Arguments are checked
once, in C++: by the torch layer what the tensors say, by the library the rest.
"""

from __future__ import annotations

import enum
import json
import threading
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .team import Team

_DESCRIPTION = json.loads(torch.ops.tpfuse.describe())

# The FP8 output's constants, include/tpfuse/limits.h's kQuantGroupSize and kQuantMinAmax (the
# passes write their patterns with these): elements per scale group along hidden, and the
# dynamic scales' floor, scale = max(amax, QUANT_MIN_AMAX) / 448.
QUANT_GROUP_SIZE = _DESCRIPTION["constants"]["kQuantGroupSize"]
QUANT_MIN_AMAX = _DESCRIPTION["constants"]["kQuantMinAmax"]


def _enum(name: str, cpp_name: str, doc: str, values=None) -> type:
    """The C++ enum `cpp_name` as an IntEnum (its enumerators' names in upper case; those in
    `values` where given)."""
    members = {enumerator.upper(): value
               for enumerator, value in _DESCRIPTION["enums"][cpp_name].items()
               if values is None or value in values}
    made = enum.IntEnum(name, members, module=__name__)
    made.__doc__ = doc
    return made


Algorithm = _enum("Algorithm", "Algorithm", """How a call moves data (tpfuse::Algorithm): AUTO
(the team's selection table decides), ONESHOT, TWOSHOT or NCCL. An op's algorithm takes a member,
its value, or its name in lower case ("auto", "oneshot", ...).""")
# Algorithm's names (as the ops take them) and values.
ALGORITHMS = {member.name.lower(): int(member) for member in Algorithm}

NormWeight = _enum("NormWeight", "NormWeight", """The weight the RMSNorm applies: GAMMA, or
ONE_PLUS_GAMMA, 1 + gamma in fp32 (Gemma's and Qwen3-Next's zero-centered weight).""")

# The FP8 ops' quant: QuantMode but its NONE (the ops without FP8 output are the ones without).
Quant = _enum("Quant", "QuantMode", """The norm's FP8 E4M3 output (tpfuse::QuantMode):
q = e4m3(norm / scale), round to nearest even, saturating at 448. STATIC takes the scale (a
float32 tensor of one element); PER_TOKEN and PER_TOKEN_GROUP_128 compute max(amax, 1e-10) / 448
per token, or per group of 128 channels ([tokens, hidden / 128], row-major), and return it;
PER_TOKEN_GROUP_128_UE8M0 rounds each group's scale up to a power of two,
2^ceil(log2(max(amax, 1e-10) / 448)) (DeepSeek-V3's UE8M0 scales, returned as float32).""",
              values=_DESCRIPTION["ops"]["allreduce_add_rmsnorm_fp8"]["enums"]["quant"]["values"])

RopeStyle = _enum("RopeStyle", "RopeStyle", """The rotary embedding after the QK norm
(tpfuse::RopeStyle): NONE, NEOX (rotate-half, as MiniMax-M2) or INTERLEAVED.""")

# The Python enum of each C++ enum, for the wrappers' defaults.
_ENUMS = {"Algorithm": Algorithm, "NormWeight": NormWeight, "QuantMode": Quant,
          "RopeStyle": RopeStyle}


def _handle(team: Union[Team, int], op: str) -> int:
    if isinstance(team, Team):
        if team.blocking_ranks_in_process and threading.active_count() == 1:
            # The call would wait for peers that no other thread can call: say so at once.
            raise RuntimeError(
                f"tpfuse.{op}: rank {team.rank} belongs to an in-process CPU team of "
                f"{team.world_size} ranks, and this process runs one thread: a call blocks until "
                "every rank has made it, so each rank needs its own thread (threading.Thread)"
            )
        return team.handle
    return int(team)


def _reject(handle: int) -> None:
    # This rank will not make the call: its turn without data, so that its peers' call ends at
    # once with an error naming it and the team goes on (tpfuse::reject_call).
    try:
        torch.ops.tpfuse.reject_call(handle)
    except RuntimeError:
        pass  # already reporting the rejection; the peers then time out instead


def _enum_value(value: Union[str, int], names: Dict[str, int], what: str, handle: int) -> int:
    """An enum argument given by name or value (the op checks values); an unknown name is this
    rank's rejected call."""
    if isinstance(value, str):
        if value not in names:
            _reject(handle)
            raise ValueError(f"{what} must be one of {sorted(names)}, got {value!r}")
        return names[value]
    return int(value)


_NO_DEFAULT = object()
_ANNOTATIONS = {"Tensor": torch.Tensor, "Optional[Tensor]": Optional[torch.Tensor], "int": int,
                "float": float, "bool": bool}


def _without_quant(team: Union[Team, int], op: str, defaults: Dict[str, Any], **given) -> None:
    """Refuses (as this rank's rejected call) an argument of the FP8 output given without quant."""
    for name, value in given.items():
        default = defaults[name]
        if value is None if default is None else value == default:
            continue
        _reject(_handle(team, op))
        shown = name if isinstance(value, torch.Tensor) else f"{name}={value!r}"
        raise ValueError(f"tpfuse.{op}: {shown} needs quant (without it the call has no FP8 "
                         "output)")


def _wrapper(name: str, doc: str, python_name: Optional[str] = None,
             without_quant: Optional[Any] = None):
    """The Python function of op `name`, written from the op's schema and description: the
    parameters in the description's order with the schema's defaults (the description's
    python_defaults where the schema has none), then a call of the op with the team's handle and
    the enums' values. With `without_quant` (the wrapper of the op without FP8 output) quant
    defaults to None, and a call without it is that op's."""
    op = getattr(torch.ops.tpfuse, name).default
    schema = op._schema
    arguments = {argument.name: argument for argument in schema.arguments}
    described = _DESCRIPTION["ops"][name]
    enums = described["enums"]
    python_name = python_name or name
    namespace: Dict[str, Any] = {"_op": op, "_handle": _handle, "_enum_value": _enum_value}
    annotations: Dict[str, Any] = {}

    # The signature: each parameter, with its default (a name bound in `namespace`).
    parameters = []
    for parameter in ["team"] + described["python"]:
        argument = arguments[parameter]
        default = argument.default_value if argument.has_default_value() else _NO_DEFAULT
        default = described["python_defaults"].get(parameter, default)
        annotations[parameter] = _ANNOTATIONS.get(str(argument.type), Any)
        if parameter == "team":
            annotations[parameter] = Union[Team, int]
        elif parameter in enums:
            annotations[parameter] = Union[str, int]
            if default is not _NO_DEFAULT:
                default = _ENUMS[enums[parameter]["enum"]](default)
        if without_quant is not None and parameter == "quant":
            default, annotations[parameter] = None, Optional[Union[str, int]]
        if default is _NO_DEFAULT:
            parameters.append(parameter)
        else:
            namespace[f"_default_{parameter}"] = default
            parameters.append(f"{parameter}=_default_{parameter}")

    # The op's arguments in the schema's order.
    values = []
    for argument in schema.arguments:
        value = argument.name
        if value == "team":
            value = "handle"
        elif value in enums:
            enumerators = _DESCRIPTION["enums"][enums[value]["enum"]]
            namespace[f"_names_{value}"] = {enumerator: number
                                           for enumerator, number in enumerators.items()
                                           if number in enums[value]["values"]}
            value = f"_enum_value({value}, _names_{value}, 'tpfuse.{python_name}: {value}', handle)"
        elif str(argument.type) == "bool":
            value = f"bool({value})"
        values.append(value)

    lines = [f"def {python_name}({', '.join(parameters)}):"]
    if without_quant is not None:
        plain = [argument.name for argument in without_quant.op._schema.arguments]
        own = [argument for argument in arguments if argument not in plain + ["quant"]]
        namespace.update(_without_quant=_without_quant, _plain=without_quant,
                         _own_defaults={argument: arguments[argument].default_value
                                        for argument in own})
        lines += ["    if quant is None:",
                  f"        _without_quant(team, {python_name!r}, _own_defaults, "
                  + ", ".join(f"{argument}={argument}" for argument in own) + ")",
                  "        return _plain(" + ", ".join(f"{a}={a}" for a in plain) + ")"]
    lines += [f"    handle = _handle(team, {python_name!r})",
              f"    return _op({', '.join(values)})"]
    exec("\n".join(lines), namespace)  # noqa: S102 -- the op's own names, not user input
    function = namespace[python_name]
    function.__module__ = __name__
    function.__doc__ = doc
    function.op = op
    returns = len(schema.returns)
    annotations["return"] = (None if returns == 0 else torch.Tensor if returns == 1
                             else Tuple[torch.Tensor, ...] if without_quant is not None
                             else Tuple[(torch.Tensor,) * returns])
    function.__annotations__ = annotations
    return function


allreduce_add_rmsnorm = _wrapper("allreduce_add_rmsnorm", """\
(norm_out, residual_out): residual_out = all-reduce(input) + residual (fp32, rank order, one
rounding), norm_out = rmsnorm(residual_out) * weight (or * (1 + weight), norm_weight).""")

allreduce_add_rmsnorm_ = _wrapper("allreduce_add_rmsnorm_", """\
In place, as engines' fused add + RMSNorm: residual <- all-reduce(input) + residual,
input <- rmsnorm(residual) * weight (or * (1 + weight), norm_weight). Without a residual use
allreduce_add_rmsnorm.""")

allreduce_add_rmsnorm_fp8 = _wrapper("allreduce_add_rmsnorm_fp8", """\
(norm_out, residual_out, quant_out, scales): allreduce_add_rmsnorm's outputs and the norm's FP8
output (quant_out float8_e4m3fn [tokens, hidden]; scales float32, see Quant; empty for STATIC;
the group modes' [tokens, hidden / 128] column-major with column_major_scales, as CUTLASS's
and DeepGEMM's blockwise FP8 GEMMs read them). With keep_norm=False no bf16 norm is written
(norm_out is [0, hidden]): for a norm whose only reader is the FP8 GEMM; the other outputs keep
their bits.""")

allreduce_add_rmsnorm_fp8_ = _wrapper("allreduce_add_rmsnorm_fp8_", """\
In place as allreduce_add_rmsnorm_ (residual <- sum + residual, input <- norm, which a MoE router
reads), and the norm's FP8 output for the experts: (quant_out, scales). With keep_norm=False input
is left as it was (no bf16 norm is written).""")

allreduce_moe_finalize_add_rmsnorm = _wrapper(
    "allreduce_moe_finalize_add_rmsnorm_fp8", """\
The MoE finalize fused in: this rank's contribution to the all-reduce is
sum_j routing_weights[t, j] * expert_rows[t, j] (+ shared_expert[t]), in fp32 with j in order,
rounded once to the rows' dtype; then as allreduce_add_rmsnorm. expert_rows [tokens, topk, hidden]
(topk <= 16), routing_weights [tokens, topk] float32 or the rows' dtype, residual
[tokens, hidden]. Returns (norm_out, residual_out), and with `quant` (see
allreduce_add_rmsnorm_fp8, keep_norm too) also (quant_out, scales): the op
allreduce_moe_finalize_add_rmsnorm_fp8, whose arguments these are.""",
    python_name="allreduce_moe_finalize_add_rmsnorm",
    without_quant=_wrapper("allreduce_moe_finalize_add_rmsnorm", ""))

allreduce = _wrapper("allreduce", """The sum over ranks (fp32, rank order, one rounding).""")

allreduce_qk_rmsnorm = _wrapper("allreduce_qk_rmsnorm", """\
(q, k) of this rank's packed qkv, normalized by the global per-token RMS of q and of k, then
optionally rotated (rope_style; cos_sin_cache: fp32 [max_position, rotary_dim], cos then sin).""")


def reject_call(team: Union[Team, int]) -> None:
    """This rank will not make the fused call its peers are making (its own checks failed, say):
    it takes its turn without data, so their call ends at once with an error naming this rank
    (NaN outputs) and the team goes on. The ops do this themselves when they reject a call."""
    torch.ops.tpfuse.reject_call(_handle(team, "reject_call"))
