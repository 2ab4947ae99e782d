"""End-to-end decode benchmark: a MiniMax-M2-shaped TP model (model.py), unfused against fused.

    python3 bench/e2e/decode.py --out-dir tpfuse-results      # one process per GPU it finds
    python3 bench/e2e/decode.py --cpu --world 2 --small ...        # the CPU run (gloo, processes)

Modes (same weights, same inputs):
  nccl      (a) NCCL all-reduce (torch.distributed, in place) + separate norms, as an engine
                without fusion runs it
  symm_mem  (b) torch symmetric-memory one-shot all-reduce + separate norms (CUDA only)
  tpfuse    (c) tpfuse's fused ops called directly (add + RMSNorm; QK norm with RoPE)
  tpfuse_compiled
            (c) compiled: the same layer, tpfuse's ops called directly, compiled with
                torch.compile: what (d) should match if its passes find every site (Inductor
                also fuses the rest of the layer, so (d) against (c) eager mixes the two)
  compiled  (d) the unfused model written with functional collectives, each layer compiled with
                torch.compile and tpfuse's passes installed
  inductor  the control for (d): the same compiled model without tpfuse's passes (NCCL
                all-reduces, Inductor's own fusions): how far a change of rounding that users
                already accept (torch.compile of (a)) moves the tokens and logits from (a)
  local     (a) without its all-reduces (wrong outputs): the floor of (a) and (b), for the share
            of their step time in collectives
  tpfuse_local
            (c) on a team of one rank per process (the same fused kernels, no exchange; wrong
            outputs): the floor of (c)

--fp8: the FP8 model (model.py: E4M3 attention and expert weights with 128x128 block scales,
activations per token group of 128, torch's block-scaled GEMM on CUDA), every mode as above; the
norms before FP8 GEMMs quantize their output (tpfuse: the ops' FP8 forms; (d): the passes fold the
quantization in; the unfused modes: torch ops after the norm). The compiled unfused layers ((d) and
its control) write that norm as HF's MiniMax-M2 does, rounding before the weight (model.py:
rms_norm_native), where the eager modes keep F.rms_norm, which rounds once as tpfuse's op does: a
last-bit difference that FP8 turns into a step of E4M3, and at a near-tied router an expert choice
(their logits then differ by more than rounding). Records carry "fp8"; the run's info
has the layer-0 GEMM check (fp8_matmul against its definition and against bf16), and the compiled
mode's records the FP8 sites its passes rewrote.

Each (mode, batch, context, layer count) is timed as a CUDA graph of one decode step (the step
feeds its argmax back as the next tokens and advances the positions), replayed; the median replay
is the step time. Two layer counts give the per-layer slope and a projection to 62 layers
(fixed part + 62 x slope). Correctness, at the larger layer count, against mode (a): the first
step's logits (relative error); the greedy tokens of 32 steps from the same state; and, since
random weights and bf16 logits give many near-ties (two logits within a bf16 step of each other,
where any change of rounding may flip the argmax), the same 32 steps teacher-forced with (a)'s
tokens: each step's logits against (a)'s, the steps whose argmax differs, and (a)'s top-2 margin
at each such step. Mode (a) runs its greedy steps twice: the model's own run-to-run
reproducibility. Results: summarized on stdout; one JSON of records with --out PATH or --out-dir DIR
(bench/results_path.py: unique names, never an overwrite).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results_path  # noqa: E402

from model import (  # noqa: E402
    Collectives,
    Config,
    Decoder,
    KvCache,
    Weights,
    grouped_gemm_works,
    relative_error,
    rms_norm,
    rms_norm_native,
    rope,
    tokens_per_second,
)

MODES = ("nccl", "symm_mem", "tpfuse", "tpfuse_compiled", "compiled", "inductor", "local",
         "tpfuse_local")
# Modes without the exchange (wrong outputs: no comparison with (a)), and whose floor each is.
LOCAL_MODES = ("local", "tpfuse_local")
FLOORS = {"nccl": "local", "symm_mem": "local", "tpfuse": "tpfuse_local"}
COMPILED_MODES = ("tpfuse_compiled", "compiled", "inductor")
# The FP8 sites of one compiled layer: the post-attention norm (the experts' input) and the
# post-MoE norm (the next layer's qkv input), each quantized per token group of 128.
FP8_SITES_PER_LAYER = 2
FP8_STAT = "allreduce_add_rmsnorm_fp8_group128"
# The peer timeout of the multi-rank teams here: every rank compiles before its first call in a
# compiled graph, and on a loaded machine (the CPU tests on 2 shared cores) one rank may get there
# tens of seconds after another. A compiling peer is not a dead one.
PEER_TIMEOUT_SECONDS = 600.0


def _split_qk(qkv, config, local):
    q_size, kv_size = local.heads * config.head_dim, local.kv_heads * config.head_dim
    return qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]


# The unfused modes' RoPE as one compiled kernel: engines run RoPE as one custom kernel, not as
# the ~20 elementwise kernels of the native form. (Mode (d) compiles the whole layer, native
# RoPE included, which its passes fold into the QK-norm op.) The CPU smoke run rotates eagerly:
# compiling there (again after each dynamo reset) costs the run more than anything it measures.
_compiled_rope = torch.compile(rope, fullgraph=True)


def _qk_norm_unfused(qkv, w, positions, cos_sin, config, local, world, reduce, rope_fn=None):
    """MiniMax-M2's QK norm as a TP engine writes it (vLLM's MiniMax-M2 QK norm: fp32 mean
    squares, one all-reduce of both, rsqrt, weights), then RoPE."""
    q, k = _split_qk(qkv, config, local)
    qf, kf = q.float(), k.float()
    variance = torch.cat(
        [qf.pow(2).mean(-1, keepdim=True), kf.pow(2).mean(-1, keepdim=True)], dim=-1
    )
    variance = reduce(variance) / world
    q_var, k_var = variance.chunk(2, dim=-1)
    q = (qf * torch.rsqrt(q_var + config.eps) * w["q_norm"]).to(qkv.dtype)
    k = (kf * torch.rsqrt(k_var + config.eps) * w["k_norm"]).to(qkv.dtype)
    if rope_fn is None:
        rope_fn = _compiled_rope if qkv.is_cuda else rope
    return rope_fn(positions, q, k, cos_sin, config.head_dim, config.rotary_dim)


class _Gather:
    def __init__(self, group, world):
        self.group, self.world = group, world

    def all_gather(self, x):
        if self.world == 1:
            return x
        import torch.distributed as dist

        # Ranks stacked along dim 0 (the form gloo takes as well as NCCL), then [batch, vocab].
        out = torch.empty((self.world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view((self.world,) + tuple(x.shape)).permute(1, 0, 2).reshape(x.shape[0], -1)


class Nccl(_Gather, Collectives):
    name = "nccl"
    norm = staticmethod(rms_norm)

    def _reduce(self, x):
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def add_rms_norm(self, partial, residual, weight, eps):
        residual = self._reduce(partial) + residual
        return self.norm(residual, weight, eps), residual

    def qk_norm_rope(self, qkv, w, positions, cos_sin, config, local, world):
        return _qk_norm_unfused(qkv, w, positions, cos_sin, config, local, world, self._reduce)


class Functional(Nccl):
    """The unfused model in the form torch.compile traces (functional collectives): mode (d)
    compiles it with tpfuse's passes installed."""

    name = "compiled"

    def __init__(self, group, world, fp8=False):
        super().__init__(group, world)
        if fp8:
            # The norm as models write it: F.rms_norm's rounding does not survive Inductor when its
            # output is quantized (model.rms_norm_native), and neither would the site.
            self.norm = rms_norm_native

    def _reduce(self, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)

    def qk_norm_rope(self, qkv, w, positions, cos_sin, config, local, world):
        # The native RoPE: the layer is compiled whole, and the passes fold RoPE into the op.
        return _qk_norm_unfused(qkv, w, positions, cos_sin, config, local, world, self._reduce,
                                rope)


class Local(Nccl):
    name = "local"

    def _reduce(self, x):
        return x


class SymmMem(Nccl):
    """torch's symmetric-memory one-shot all-reduce (no multicast): the input is copied into a
    symmetric buffer, reduced, then the separate norms."""

    name = "symm_mem"

    def __init__(self, group, world, max_tokens, hidden, device):
        super().__init__(group, world)
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.buffers = {}
        for dtype, width in ((torch.bfloat16, hidden), (torch.float32, 2)):
            buffer = symm_mem.empty((max_tokens, width), dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, self.group_name)
            self.buffers[dtype] = buffer

    def _reduce(self, x):
        buffer = self.buffers[x.dtype][: x.shape[0]]
        buffer.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", self.group_name)


class Tpfuse(_Gather, Collectives):
    name = "tpfuse"

    def __init__(self, group, world, team):
        super().__init__(group, world)
        import tpfuse

        self.ops, self.team = tpfuse, team
        # The quant mode as a plain int, read once here: dynamo does not trace the wrappers'
        # lookup of the enum.
        self.group128 = int(tpfuse.Quant.PER_TOKEN_GROUP_128)

    def add_rms_norm(self, partial, residual, weight, eps):
        return self.ops.allreduce_add_rmsnorm(self.team, partial, residual, weight, eps)

    def moe_add_rms_norm(self, rows, weights, residual, weight, eps):
        # The MoE combine in the all-reduce's kernel (its sum in expert order).
        return self.ops.allreduce_moe_finalize_add_rmsnorm(self.team, rows, weights, residual,
                                                           weight, eps)

    # The FP8 forms: the norm's FP8 output from the same kernel, its scales column-major as the
    # block-scaled GEMM reads them. The torch ops themselves: dynamo does not trace the wrappers'
    # lookup of the quant mode (a dict built from the enum).
    def add_rms_norm_fp8(self, partial, residual, weight, eps):
        return torch.ops.tpfuse.allreduce_add_rmsnorm_fp8(
            self.team.handle, partial, residual, weight, eps, self.group128, None, True, 0, 0)

    def moe_add_rms_norm_fp8(self, rows, weights, residual, weight, eps):
        return torch.ops.tpfuse.allreduce_moe_finalize_add_rmsnorm_fp8(
            self.team.handle, rows, weights, residual, weight, eps, self.group128, None, True,
            None, 0)

    def qk_norm_rope(self, qkv, w, positions, cos_sin, config, local, world):
        q_size, kv_size = local.heads * config.head_dim, local.kv_heads * config.head_dim
        return self.ops.allreduce_qk_rmsnorm(
            self.team, qkv, w["q_norm"], w["k_norm"], q_size, kv_size,
            config.heads * config.head_dim, config.kv_heads * config.head_dim, config.eps,
            kv_replicas=local.kv_replicas, positions=positions, cos_sin_cache=cos_sin,
            head_dim=config.head_dim, rotary_dim=config.rotary_dim,
            rope_style=self.ops.RopeStyle.NEOX,
        )


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def _commit() -> str:
    if os.environ.get("TPFUSE_BENCH_COMMIT"):
        return os.environ["TPFUSE_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def replay_times(graph, replays, barrier):
    """ms of each of `replays` replays of a captured CUDA graph, timed with events, each started
    after `barrier` (every rank together)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


class Runner:
    """One rank's part of the benchmark."""

    def __init__(self, args, rank, world, device, group):
        self.args, self.rank, self.world, self.device, self.group = args, rank, world, device, group
        self.config = Config(layers=max(args.layers), experts=args.experts, vocab=args.vocab)
        if args.small:
            # FP8 GEMMs take whole 128-blocks: the experts' intermediate width 128 per rank at 2.
            self.config = Config(hidden=256, heads=4, kv_heads=2, head_dim=64, rotary_dim=32,
                                 experts=8, top_k=2, expert_inter=256 if args.fp8 else 128,
                                 vocab=512, layers=max(args.layers), max_position=4096)
        self.weights = Weights(self.config, rank, world, device, fp8=args.fp8)
        if args.fp8:
            self.check_fp8_gemms()
        self.grouped = grouped_gemm_works(device)
        self.cuda = device.type == "cuda"
        self.team = self.local_team = None
        if {"tpfuse", "tpfuse_compiled", "compiled"} & set(args.modes):
            import tpfuse

            if world == 1:
                # One process: a one-rank team of this device (the CPU smoke run's, or one GPU's).
                (self.team,) = (tpfuse.cuda_team([self.device.index]) if self.cuda
                                else tpfuse.cpu_team(1))
            else:
                self.team = tpfuse.Team.from_group(group, peer_timeout_seconds=PEER_TIMEOUT_SECONDS)

    def check_fp8_gemms(self):
        """Refuses to time an FP8 model whose block-scaled GEMM does not compute its definition
        (a scale layout read otherwise than written would give wrong numbers, not an error)."""
        worst = max(c["rel_err_vs_dequantized"] for c in self.weights.fp8_check.values())
        if worst > 1e-2:
            raise RuntimeError(f"FP8 GEMM check: {worst:.3g} relative error against the "
                               f"dequantized product ({self.weights.fp8_check})")

    def collectives(self, mode, batch):
        if mode == "nccl":
            return Nccl(self.group, self.world)
        if mode in ("compiled", "inductor"):
            return Functional(self.group, self.world, fp8=self.args.fp8)
        if mode == "local":
            return Local(self.group, self.world)
        if mode in ("tpfuse", "tpfuse_compiled"):
            return Tpfuse(self.group, self.world, self.team)
        if mode == "tpfuse_local":
            import tpfuse

            if self.local_team is None:
                (self.local_team,) = (tpfuse.cuda_team([self.device.index]) if self.cuda
                                      else tpfuse.cpu_team(1))
            return Tpfuse(self.group, self.world, self.local_team)
        if mode == "symm_mem":
            return SymmMem(self.group, self.world, batch, self.config.hidden, self.device)
        raise ValueError(f"unknown mode {mode}")

    def state(self, batch, context):
        generator = torch.Generator().manual_seed(batch * 7919 + context)
        tokens = torch.randint(0, self.config.vocab, (batch,), generator=generator)
        return (
            tokens.to(self.device),
            torch.full((batch,), context, dtype=torch.int64, device=self.device),
            torch.zeros(1, dtype=torch.int64, device=self.device),
        )

    def run(self):
        records = []
        if self.args.fp8:
            # Not a timing: main() moves it into the results' info.
            records.append({"kind": "fp8_gemm_check", "rank": self.rank,
                            "check": self.weights.fp8_check})
        for batch in self.args.batches:
            for context in self.args.contexts:
                cache = KvCache(self.config, self.weights.local, batch, context, self.rank,
                                self.device)
                reference = None
                for mode in self.args.modes:
                    if mode == "symm_mem" and (not self.cuda or self.world == 1):
                        continue
                    try:
                        collectives = self.collectives(mode, batch)
                    except Exception as error:  # noqa: BLE001 -- reported, the run goes on
                        records.append(self.record(mode, batch, context, 0,
                                                   error=f"{type(error).__name__}: {error}"))
                        continue
                    if mode in COMPILED_MODES:
                        # A fresh compile per (mode, batch, context): no cache entry of another
                        # mode, and never dynamo's recompile limit (past it, it runs eager).
                        torch._dynamo.reset()
                    if mode == "compiled":
                        import tpfuse.passes as passes

                        fusion = passes.install(self.team, self.group)
                    for layers in sorted(self.args.layers):
                        decoder = Decoder(self.weights, cache, collectives, self.world,
                                          self.grouped, layers=layers,
                                          compile_layer=mode in COMPILED_MODES)
                        record = self.measure(decoder, mode, batch, context, layers)
                        if mode == "compiled":
                            # What (mode, batch, context) compiled so far (one layer graph,
                            # reused by every layer count): the rewrites, and what the last
                            # graph still holds (every all-reduce fused: none left).
                            record["pass_rewrites"] = dict(fusion.stats)
                            record["graphs_compiled"] = len(fusion.graphs)
                            if fusion.graphs:
                                after = fusion.graphs[-1]["after"]
                                record["last_graph_all_reduces_left"] = sum(
                                    "all_reduce" in op for op in after)
                                record["last_graph_tpfuse_ops"] = sum(
                                    op.startswith("tpfuse.") for op in after)
                                if self.args.fp8:
                                    record["last_graph_tpfuse_fp8_ops"] = sum(
                                        op.startswith("tpfuse.") and "_fp8" in op
                                        for op in after)
                            if self.args.fp8:
                                # Per layer graph: the two norms' quantizations, folded in.
                                record["fp8_sites_rewritten"] = fusion.stats[FP8_STAT]
                                record["fp8_sites_expected"] = (FP8_SITES_PER_LAYER
                                                                * len(fusion.graphs))
                        # 'local' computes without collectives: its outputs are not comparable.
                        if layers == max(self.args.layers) and mode not in LOCAL_MODES:
                            tokens, logits, margins = self.greedy(decoder, cache, batch,
                                                                  context)
                            if mode == "nccl":
                                again = self.greedy(decoder, cache, batch, context)
                                record["repeat_greedy_steps_equal"] = equal_steps(again[0],
                                                                                  tokens)
                                record["repeat_logits_rel_err"] = relative_error(again[1], logits)
                                reference = (tokens, logits, margins,
                                             self.forced(decoder, cache, batch, context, tokens))
                            if reference is not None:
                                record.update(self.compare(decoder, cache, batch, context,
                                                           tokens, logits, reference))
                        records.append(record)
                        self.save_partial(record)
                    if mode == "compiled":
                        import tpfuse.passes as passes

                        passes.uninstall()
        return records

    def step_fn(self, decoder, tokens, positions, slot, context):
        def step():
            logits = decoder.step(tokens, positions, slot)
            tokens.copy_(logits.argmax(-1))
            positions.add_(1)
            slot.copy_((slot + 1) % context)
            return logits

        return step

    def measure(self, decoder, mode, batch, context, layers):
        tokens, positions, slot = self.state(batch, context)
        step = self.step_fn(decoder, tokens, positions, slot, context)
        times = []
        if self.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            times = replay_times(graph, self.args.replays, self.barrier)
            eager = []
            for _ in range(5):
                self.barrier()
                torch.cuda.synchronize()
                begin = time.perf_counter()
                step()
                torch.cuda.synchronize()
                eager.append((time.perf_counter() - begin) * 1e3)
            del graph
        else:
            step()  # warm-up (compiles)
            for _ in range(self.args.replays):
                begin = time.perf_counter()
                step()
                times.append((time.perf_counter() - begin) * 1e3)
            eager = times
        ms = statistics.median(times)
        record = self.record(mode, batch, context, layers)
        record.update(ms_per_step=ms, eager_ms_per_step=statistics.median(eager),
                      tokens_per_s=tokens_per_second(batch, ms),
                      method="cuda graph of one decode step, median of replays"
                      if self.cuda else "eager, wall time, median")
        return record

    def greedy(self, decoder, cache, batch, context):
        """32 steps (argmax fed back) from the same state: the tokens, and the first logits."""
        cache.reset()
        tokens, positions, slot = self.state(batch, context)
        step = self.step_fn(decoder, tokens, positions, slot, context)
        history, margins, first = [], [], None
        for index in range(self.args.greedy_steps):
            logits = step()
            if index == 0:
                first = logits.float().cpu()
            history.append(tokens.cpu().clone())
            # The gap between the two largest logits (smallest over the batch): a step whose
            # gap is within rounding can flip its argmax between modes that round differently.
            top2 = logits.float().topk(2, dim=-1).values
            margins.append(float((top2[:, 0] - top2[:, 1]).min()))
        cache.reset()
        return torch.stack(history), first, margins

    def save_partial(self, record):
        """Rank 0 appends each record to <out>.partial.jsonl as it is made: a run cut short
        (a time limit, a hang in a later mode) keeps what it measured."""
        if self.rank == 0 and self.args.out:
            with open(self.args.out + ".partial.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")

    def forced(self, decoder, cache, batch, context, reference_tokens):
        """The greedy steps teacher-forced with `reference_tokens` (mode (a)'s): each step's
        logits (on the device, fp32) and argmax, every mode fed the same tokens."""
        cache.reset()
        tokens, positions, slot = self.state(batch, context)
        step = self.step_fn(decoder, tokens, positions, slot, context)
        logits, argmax = [], []
        for index in range(reference_tokens.shape[0]):
            out = step()
            logits.append(out.float())
            argmax.append(tokens.cpu().clone())
            tokens.copy_(reference_tokens[index].to(tokens.device))
        cache.reset()
        return logits, torch.stack(argmax)

    def compare(self, decoder, cache, batch, context, tokens, logits, reference):
        """This mode against mode (a): first logits, greedy tokens, and teacher-forced steps."""
        ref_tokens, ref_logits, ref_margins, (ref_forced, _) = reference
        equal = equal_steps(tokens, ref_tokens)
        result = {
            "logits_rel_err_vs_nccl": relative_error(logits, ref_logits),
            "greedy_steps_equal_nccl": equal,
            "greedy_steps": int(tokens.shape[0]),
            "nccl_top2_margin_median": statistics.median(ref_margins),
        }
        if equal < tokens.shape[0]:
            # Where the tokens first differ: how close (a)'s top two logits were there.
            result["nccl_top2_margin_at_first_difference"] = ref_margins[equal]
        forced, argmax = self.forced(decoder, cache, batch, context, ref_tokens)
        errors = [relative_error(a, b) for a, b in zip(forced, ref_forced)]
        differ = [i for i in range(len(forced)) if not bool((argmax[i] == ref_tokens[i]).all())]
        result.update(
            forced_logits_rel_err_max=max(errors),
            forced_logits_rel_err_median=statistics.median(errors),
            forced_steps_argmax_differs=len(differ),
            forced_nccl_top2_margin_max_where_differs=max(
                (ref_margins_forced(ref_forced[i], argmax[i]) for i in differ), default=None),
        )
        return result

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def record(self, mode, batch, context, layers, error=None):
        c = self.config
        moe = "grouped_mm" if self.grouped else "gathered_bmm"
        record = {
            "mode": mode, "batch": batch, "context": context, "layers": layers,
            "world_size": self.world, "fp8": self.args.fp8,
            "moe": "fp8_gathered_pairs" if self.args.fp8 else moe,
            "config": {"hidden": c.hidden, "heads": c.heads, "kv_heads": c.kv_heads,
                       "head_dim": c.head_dim, "rotary_dim": c.rotary_dim, "experts": c.experts,
                       "top_k": c.top_k, "expert_inter": c.expert_inter, "vocab": c.vocab},
        }
        if error is not None:
            record["error"] = error
        return record


def equal_steps(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    """How many greedy steps [steps, batch] agree with the reference before the first that
    does not."""
    return int((tokens == reference).all(dim=1).cumprod(0).sum())


def ref_margins_forced(ref_logits: torch.Tensor, argmax: torch.Tensor) -> float:
    """At a teacher-forced step where a mode's argmax differs from (a)'s: the largest, over the
    sequences that differ, of (a)'s logit gap between its own top token and the mode's."""
    top = ref_logits.max(dim=-1).values
    chosen = ref_logits.gather(1, argmax.to(ref_logits.device).view(-1, 1)).squeeze(1)
    return float((top - chosen).max())


def summarize(records):
    """Per (mode, batch, context): step time at each layer count, the per-layer slope, the
    projection to 62 layers, tokens/s there, and the collectives' share (against 'local')."""
    by_key = {}
    for r in records:
        if "ms_per_step" in r:
            by_key.setdefault((r["mode"], r["batch"], r["context"]), {})[r["layers"]] = r
    summary = []
    for (mode, batch, context), by_layers in sorted(by_key.items()):
        counts = sorted(by_layers)
        entry = {"mode": mode, "batch": batch, "context": context,
                 "fp8": by_layers[counts[0]].get("fp8", False),
                 "ms_per_step": {str(n): by_layers[n]["ms_per_step"] for n in counts}}
        if len(counts) >= 2:
            low, high = counts[0], counts[-1]
            slope = (by_layers[high]["ms_per_step"] - by_layers[low]["ms_per_step"]) / (high - low)
            projected = by_layers[low]["ms_per_step"] + (62 - low) * slope
            entry.update(ms_per_layer=slope, projected_ms_per_step_62_layers=projected,
                         projected_tokens_per_s_62_layers=tokens_per_second(batch, projected))
        top = by_layers[counts[-1]]
        for name in ("logits_rel_err_vs_nccl", "greedy_steps_equal_nccl", "greedy_steps",
                     "nccl_top2_margin_median", "nccl_top2_margin_at_first_difference",
                     "forced_logits_rel_err_max", "forced_logits_rel_err_median",
                     "forced_steps_argmax_differs", "forced_nccl_top2_margin_max_where_differs",
                     "repeat_greedy_steps_equal", "repeat_logits_rel_err",
                     "pass_rewrites", "graphs_compiled", "last_graph_all_reduces_left",
                     "last_graph_tpfuse_ops", "last_graph_tpfuse_fp8_ops", "fp8_sites_rewritten",
                     "fp8_sites_expected"):
            if name in top:
                entry[name] = top[name]
        summary.append(entry)
    # The share of a mode's step in collectives, against its floor (FLOORS): 'local' is (a) and
    # (b) without their all-reduces (the same separate norms), 'tpfuse_local' is (c)'s fused
    # kernels on a team of one (their norms are inside the collective op).
    floor = {(s["mode"], s["batch"], s["context"]): s for s in summary}
    for s in summary:
        if s["mode"] not in FLOORS:
            continue
        base = floor.get((FLOORS[s["mode"]], s["batch"], s["context"]))
        if base and "ms_per_layer" in s and "ms_per_layer" in base and s["ms_per_layer"] > 0:
            s["collective_share_per_layer"] = 1 - base["ms_per_layer"] / s["ms_per_layer"]
    return summary


def print_summary(summary):
    print(f"{'mode':>15} {'batch':>5} {'ctx':>5} {'ms/layer':>9} {'ms/step@62':>11} "
          f"{'tok/s@62':>9} {'coll.share':>10} {'logit err':>9} {'greedy=':>7} "
          f"{'forced err':>10} {'forced diff':>11} {'margin':>7}")
    for s in summary:
        def fmt(name, spec):
            return format(s[name], spec) if s.get(name) is not None else "-"

        greedy = (f"{s['greedy_steps_equal_nccl']}/{s['greedy_steps']}"
                  if "greedy_steps" in s else "-")
        print(f"{s['mode']:>15} {s['batch']:>5} {s['context']:>5} {fmt('ms_per_layer', '9.4f')} "
              f"{fmt('projected_ms_per_step_62_layers', '11.3f')} "
              f"{fmt('projected_tokens_per_s_62_layers', '9.1f')} "
              f"{fmt('collective_share_per_layer', '10.2f')} "
              f"{fmt('logits_rel_err_vs_nccl', '9.2e')} {greedy:>7} "
              f"{fmt('forced_logits_rel_err_max', '10.2e')} "
              f"{fmt('forced_steps_argmax_differs', '11d')} "
              f"{fmt('forced_nccl_top2_margin_max_where_differs', '7.3f')}")
    for s in summary:
        if "fp8_sites_rewritten" in s:
            print(f"{s['mode']} batch {s['batch']} context {s['context']}: the passes rewrote "
                  f"{s['fp8_sites_rewritten']} of {s['fp8_sites_expected']} FP8 sites "
                  f"(last graph: {s.get('last_graph_tpfuse_fp8_ops', 0)} tpfuse FP8 ops)")


# What the FP8 mode runs (the results' info says it, beside the layer-0 GEMM check).
FP8_FORMAT = {
    "weights": "float8_e4m3fn, qkv / o / experts' gate-up and down, one fp32 scale per 128x128 "
               "block (max(amax, 1e-10) / 448), quantized from the bf16 model's weights",
    "activations": "float8_e4m3fn per token and group of 128 channels, dynamic fp32 scales",
    "gemm_cuda": "aten._scaled_mm_v2 (torch.nn.functional.scaled_mm's op), BlockWise1x128 x "
                 "BlockWise128x128, bf16 out",
    "gemm_other": "both operands dequantized to fp32, one matmul, rounded to bf16",
    "experts": "FP8 weights gathered per (token, expert) pair, up to 16 pairs a block-scaled GEMM "
               "(block diagonal kept): torch 2.11 has no block-scaled grouped GEMM on Hopper",
}


def init_rank(rank, world, cpu, store_path):
    """One spawned rank's process group (gloo on the CPU, else NCCL on GPU `rank`), with NVLink
    multicast kept off; returns the rank's device."""
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    import torch.distributed as dist

    if cpu:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, device_id=device)
    return device


def run_ranks(rank_main, world, args):
    """Runs rank_main(rank, world, args, store_path, queue) in `world` spawned processes; each
    puts (rank, records, error text or None) on the queue. Returns rank 0's records, or None
    after printing every rank's error."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    processes = [context.Process(target=rank_main, args=(r, world, args, store, queue))
                 for r in range(world)]
    for process in processes:
        process.start()
    results = [queue.get() for _ in processes]
    for process in processes:
        process.join(timeout=60)
    errors = [f"rank {rank}:\n{error}" for rank, _, error in results if error]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return None
    return next(records for rank, records, _ in results if rank == 0)


def run_info(cpu, world):
    """What a results file records of the machine and the code."""
    return {
        "device": torch.cuda.get_device_name(0) if not cpu else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if not cpu else "",
        "cuda": torch.version.cuda or "",
        "driver": _driver() if not cpu else "",
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "world_size": world,
    }


def _rank_main(rank, world, args, store_path, queue):
    try:
        import torch.distributed as dist

        device = init_rank(rank, world, args.cpu, store_path)
        # Every compile runs the passes (a graph-cache hit would skip them, and their counts);
        # compiled kernels stay cached, so ranks that generate the same code build it once.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        if args.sdpa != "default":
            # One attention backend only (the default lets torch choose per call).
            for name in ("flash", "mem_efficient", "cudnn", "math"):
                getattr(torch.backends.cuda, f"enable_{name}_sdp")(
                    name == {"efficient": "mem_efficient"}.get(args.sdpa, args.sdpa))
        runner = Runner(args, rank, world, device, dist.group.WORLD)
        records = runner.run()
        queue.put((rank, records, None))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent
        queue.put((rank, None, traceback.format_exc()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    parser.add_argument("--batches", type=ints, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=ints, default=[512, 4096])
    parser.add_argument("--layers", type=ints, default=[2, 8],
                        help="two layer counts: the per-layer slope and the 62-layer projection "
                             "(far apart: the projection multiplies the slope's noise by 62)")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=200064)
    parser.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--greedy-steps", type=int, default=32)
    parser.add_argument("--world", type=int, default=0,
                        help="ranks (default: every GPU; with --cpu, 1)")
    parser.add_argument("--cpu", action="store_true",
                        help="the CPU run: gloo, one process a rank, tpfuse's CPU backend over "
                             "shared memory")
    parser.add_argument("--small", action="store_true", help="a tiny config (smoke tests)")
    parser.add_argument("--fp8", action="store_true",
                        help="the FP8 model (block-scaled E4M3 attention and expert weights, "
                             "activations per token group of 128; see model.py)")
    parser.add_argument("--sdpa", default="flash",
                        choices=("default", "flash", "efficient", "cudnn", "math"),
                        help="the attention backend (default flash: torch's own choice for "
                             "these shapes gives other bits from run to run on an H200 pair, "
                             "which makes comparing modes' tokens meaningless)")
    results_path.add_arguments(parser)
    args = parser.parse_args(argv)
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r} (known: {', '.join(MODES)})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        world = args.world or 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPUs: run with --cpu for the CPU smoke run", file=sys.stderr)
            return 2
        world = args.world or torch.cuda.device_count()
    info = dict(run_info(args.cpu, world), sdpa=args.sdpa, fp8=args.fp8)
    # The file is made now, so that the ranks' partial records go beside it under its name.
    args.out = results_path.reserve(args, info["device"], world, info["commit"],
                                    "e2e-fp8" if args.fp8 else "e2e")
    records = run_ranks(_rank_main, world, args)
    if records is None:
        if args.out and os.path.getsize(args.out) == 0:
            os.remove(args.out)
        return 1
    if args.fp8:
        check = next(r["check"] for r in records if r.get("kind") == "fp8_gemm_check")
        records = [r for r in records if r.get("kind") != "fp8_gemm_check"]
        info["fp8_format"] = dict(FP8_FORMAT, gemm_check_layer0_rank0=check)
        print("FP8 GEMM check (layer 0, rank 0), worst relative error: against the dequantized "
              f"product {max(c['rel_err_vs_dequantized'] for c in check.values()):.2e}, against "
              f"bf16 {max(c['rel_err_vs_bf16'] for c in check.values()):.2e}")
    summary = summarize(records)
    print_summary(summary)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"info": info, "summary": summary, "records": records}, file, indent=1)
        print(f"wrote {args.out}")
        if os.path.exists(args.out + ".partial.jsonl"):
            os.remove(args.out + ".partial.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
