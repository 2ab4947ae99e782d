"""The fused ops, as thin calls of the C++-registered torch ops."""

from __future__ import annotations

import enum
import threading
from typing import Optional, Tuple, Union

import torch

from .team import Team

ALGORITHMS = {"auto": 0, "oneshot": 1, "twoshot": 2, "nccl": 3}

# The FP8 output's constants, the values of include/tpfuse/limits.h's kQuantGroupSize and
# kQuantMinAmax (the package's one copy; tests/python/test_passes_fp8_cpu.py checks them against
# the op's outputs): elements per scale group along hidden, and the dynamic scales' floor,
# scale = max(amax, QUANT_MIN_AMAX) / 448.
QUANT_GROUP_SIZE = 128
QUANT_MIN_AMAX = 1e-10


class NormWeight(enum.IntEnum):
    """The weight the RMSNorm applies: gamma, or 1 + gamma in fp32 (Gemma's and Qwen3-Next's
    zero-centered weight)."""

    GAMMA = 0
    ONE_PLUS_GAMMA = 1


class RopeStyle(enum.IntEnum):
    NONE = 0
    NEOX = 1  # rotate-half, as MiniMax-M2
    INTERLEAVED = 2


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


def _named(value: Union[str, int], names: dict, what: str, handle: int) -> int:
    """An enum argument given by name or value; an unknown name is this rank's rejected call."""
    if isinstance(value, str):
        if value not in names:
            _reject(handle)
            raise ValueError(f"{what} must be one of {sorted(names)}, got {value!r}")
        return names[value]
    return int(value)


def _algorithm(algorithm: Union[str, int], handle: int) -> int:
    return _named(algorithm, ALGORITHMS, "algorithm", handle)


def allreduce_add_rmsnorm(
    team: Union[Team, int],
    input: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    algorithm: Union[str, int] = "auto",
    norm_weight: int = NormWeight.GAMMA,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm_out, residual_out): residual_out = all-reduce(input) + residual (fp32, rank order,
    one rounding), norm_out = rmsnorm(residual_out) * weight (or * (1 + weight), norm_weight)."""
    handle = _handle(team, "allreduce_add_rmsnorm")
    return torch.ops.tpfuse.allreduce_add_rmsnorm(
        handle, input, residual, weight, eps, _algorithm(algorithm, handle), int(norm_weight)
    )


def allreduce_add_rmsnorm_(
    team: Union[Team, int],
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    algorithm: Union[str, int] = "auto",
    norm_weight: int = NormWeight.GAMMA,
) -> None:
    """In place, as engines' fused add + RMSNorm: residual <- all-reduce(input) + residual,
    input <- rmsnorm(residual) * weight (or * (1 + weight), norm_weight)."""
    handle = _handle(team, "allreduce_add_rmsnorm_")
    if not isinstance(residual, torch.Tensor):
        _reject(handle)
        raise TypeError(
            "tpfuse.allreduce_add_rmsnorm_: residual must be a tensor (the in-place op writes the "
            "sum into it); without a residual use allreduce_add_rmsnorm"
        )
    torch.ops.tpfuse.allreduce_add_rmsnorm_(
        handle, input, residual, weight, eps, _algorithm(algorithm, handle), int(norm_weight)
    )


class Quant(enum.IntEnum):
    """The norm's FP8 E4M3 output (tpfuse::QuantMode): q = e4m3(norm / scale), round to nearest
    even, saturating at 448. STATIC takes the scale (a float32 tensor of one element); PER_TOKEN
    and PER_TOKEN_GROUP_128 compute max(amax, 1e-10) / 448 per token, or per group of 128
    channels ([tokens, hidden / 128], row-major), and return it."""

    STATIC = 1
    PER_TOKEN = 2
    PER_TOKEN_GROUP_128 = 3


def _quant(quant: Union[str, int], handle: int) -> int:
    return _named(quant, {q.name.lower(): int(q) for q in Quant}, "quant", handle)


def allreduce_add_rmsnorm_fp8(
    team: Union[Team, int],
    input: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    quant: Union[str, int],
    scale: Optional[torch.Tensor] = None,
    algorithm: Union[str, int] = "auto",
    norm_weight: int = NormWeight.GAMMA,
    column_major_scales: bool = False,
    keep_norm: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norm_out, residual_out, quant_out, scales): allreduce_add_rmsnorm's outputs and the
    norm's FP8 output (quant_out float8_e4m3fn [tokens, hidden]; scales float32, see Quant;
    empty for STATIC; PER_TOKEN_GROUP_128's [tokens, hidden / 128] column-major with
    column_major_scales, as CUTLASS's and DeepGEMM's blockwise FP8 GEMMs read them). With
    keep_norm=False no bf16 norm is written (norm_out is [0, hidden]): for a norm whose only
    reader is the FP8 GEMM; the other outputs keep their bits."""
    handle = _handle(team, "allreduce_add_rmsnorm_fp8")
    return torch.ops.tpfuse.allreduce_add_rmsnorm_fp8(
        handle, input, residual, weight, eps, _quant(quant, handle), scale,
        bool(column_major_scales), _algorithm(algorithm, handle), int(norm_weight),
        bool(keep_norm),
    )


def allreduce_add_rmsnorm_fp8_(
    team: Union[Team, int],
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quant: Union[str, int],
    scale: Optional[torch.Tensor] = None,
    algorithm: Union[str, int] = "auto",
    norm_weight: int = NormWeight.GAMMA,
    column_major_scales: bool = False,
    keep_norm: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In place as allreduce_add_rmsnorm_ (residual <- sum + residual, input <- norm, which a
    MoE router reads), and the norm's FP8 output for the experts: (quant_out, scales). With
    keep_norm=False input is left as it was (no bf16 norm is written)."""
    handle = _handle(team, "allreduce_add_rmsnorm_fp8_")
    if not isinstance(residual, torch.Tensor):
        _reject(handle)
        raise TypeError("tpfuse.allreduce_add_rmsnorm_fp8_: residual must be a tensor (the "
                        "in-place op writes the sum into it)")
    return torch.ops.tpfuse.allreduce_add_rmsnorm_fp8_(
        handle, input, residual, weight, eps, _quant(quant, handle), scale,
        bool(column_major_scales), _algorithm(algorithm, handle), int(norm_weight),
        bool(keep_norm),
    )


def allreduce_moe_finalize_add_rmsnorm(
    team: Union[Team, int],
    expert_rows: torch.Tensor,
    routing_weights: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    shared_expert: Optional[torch.Tensor] = None,
    quant: Union[str, int, None] = None,
    scale: Optional[torch.Tensor] = None,
    algorithm: Union[str, int] = "auto",
    column_major_scales: bool = False,
    keep_norm: bool = True,
) -> Tuple[torch.Tensor, ...]:
    """The MoE finalize fused in: this rank's contribution to the all-reduce is
    sum_j routing_weights[t, j] * expert_rows[t, j] (+ shared_expert[t]), in fp32 with j in order,
    rounded once to the rows' dtype; then as allreduce_add_rmsnorm. expert_rows
    [tokens, topk, hidden] (topk <= 16), routing_weights [tokens, topk] float32 or the rows'
    dtype, residual [tokens, hidden]. Returns (norm_out, residual_out), and with `quant` (see
    allreduce_add_rmsnorm_fp8, keep_norm too) also (quant_out, scales)."""
    name = "allreduce_moe_finalize_add_rmsnorm"
    handle = _handle(team, name)
    if quant is None:
        if not keep_norm:
            _reject(handle)
            raise ValueError(f"tpfuse.{name}: keep_norm=False needs quant (the FP8 output would "
                             "be the norm's only output)")
        return torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm(
            handle, expert_rows, routing_weights, residual, weight, eps, shared_expert,
            _algorithm(algorithm, handle),
        )
    return torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm_fp8(
        handle, expert_rows, routing_weights, residual, weight, eps, _quant(quant, handle), scale,
        bool(column_major_scales), shared_expert, _algorithm(algorithm, handle), bool(keep_norm),
    )


def allreduce(
    team: Union[Team, int], input: torch.Tensor, algorithm: Union[str, int] = "auto"
) -> torch.Tensor:
    """The sum over ranks (fp32, rank order, one rounding)."""
    handle = _handle(team, "allreduce")
    return torch.ops.tpfuse.allreduce(handle, input, _algorithm(algorithm, handle))


def allreduce_qk_rmsnorm(
    team: Union[Team, int],
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_size: int,
    kv_size: int,
    q_global_size: int,
    k_global_size: int,
    eps: float,
    kv_replicas: int = 1,
    positions: Optional[torch.Tensor] = None,
    cos_sin_cache: Optional[torch.Tensor] = None,
    head_dim: int = 0,
    rotary_dim: int = 0,
    rope_style: int = RopeStyle.NONE,
    algorithm: Union[str, int] = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, k) of this rank's packed qkv, normalized by the global per-token RMS of q and of k,
    then optionally rotated (cos_sin_cache: fp32 [max_position, rotary_dim], cos then sin)."""
    handle = _handle(team, "allreduce_qk_rmsnorm")
    return torch.ops.tpfuse.allreduce_qk_rmsnorm(
        handle,
        qkv,
        q_weight,
        k_weight,
        q_size,
        kv_size,
        q_global_size,
        k_global_size,
        kv_replicas,
        eps,
        positions,
        cos_sin_cache,
        head_dim,
        rotary_dim,
        int(rope_style),
        _algorithm(algorithm, handle),
    )


def reject_call(team: Union[Team, int]) -> None:
    """This rank will not make the fused call its peers are making (its own checks failed, say):
    it takes its turn without data, so their call ends at once with an error naming this rank
    (NaN outputs) and the team goes on. The ops do this themselves when they reject a call."""
    torch.ops.tpfuse.reject_call(_handle(team, "reject_call"))
