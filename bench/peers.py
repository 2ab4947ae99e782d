"""tpfuse-bench's peers step: the fused all-reduce + add + RMSNorm of the strongest peers, measured
with tpfuse-bench's method on its shapes, in the same GPU run, into the same results file.

    python3 bench/peers.py --results RUN.json [--hidden 3072,7168] [--tokens 1,2,...,8192]
                           [--ops-per-graph 20] [--replays 50]
    python3 bench/peers.py --out-dir DIR ...   (a file of its own instead)

With two or more GPUs (one process per GPU, NCCL group), op allreduce_add_rmsnorm:
  flashinfer_oneshot, flashinfer_twoshot, flashinfer_auto  FlashInfer's TensorRT-LLM fused kernels
      (kARResidualRMSNorm; one-shot forced, two-shot forced, its own choice), called as vLLM
      calls them: in place, fp32 accumulation, PDL
  symm_mem_oneshot+tpfuse_local, symm_mem_twoshot+tpfuse_local  torch's symmetric-memory
      all-reduce (no multicast) into a buffer, then tpfuse's local add + RMSNorm kernel
  tpfuse_torch  tpfuse's op from torch, in place (Team.from_group, the selector's choice)
and ops allreduce_add_rmsnorm_fp8 (a static scale) and allreduce_add_rmsnorm_fp8_token (a scale
per token): the same norm kept in bf16 (in place) and its FP8 E4M3 bytes, tpfuse_torch against
flashinfer_oneshot / _twoshot / _auto with the patterns that keep the norm too
(kARResidualRMSNormOutFP8Quant, kARResidualRMSNormOutDynamicFP8Quant); and the FP8 bytes alone
(no bf16 norm written), tpfuse_torch_no_norm (keep_norm=False) against flashinfer_*_no_norm
(kARResidualRMSNormFP8Quant, kARResidualRMSNormDynamicFP8Quant); --skip-fp8 leaves them out
and op allreduce_moe_finalize_add_rmsnorm (MiniMax-M2's top-8 combine of [tokens, 8, hidden]
expert rows by bf16 routing weights, then the all-reduce + add + RMSNorm), up to 1024 tokens:
  tpfuse_torch  tpfuse.allreduce_moe_finalize_add_rmsnorm (out of place)
  flashinfer_moe_finalize  FlashInfer's kMoEFinalizeARResidualRMSNorm (one-shot, in place), its
      permuted rows the same [tokens * 8, hidden] buffer through an identity index map
On every run, on GPU 0, op add_rmsnorm (the local kernels, in place as engines call them):
  flashinfer_fused_add_rmsnorm, tpfuse_one_rank (a one-rank team: tpfuse's local kernel), and
  with --with-compile torch_compile (add + RMSNorm in torch, compiled by Inductor)

Method, tpfuse-bench's: per shape and impl, one eager call, then a CUDA graph of ops-per-graph
back-to-back ops rotating over 4 buffer sets, 3 warm-up replays, then `replays` replays each
started by every rank together (an NCCL all-reduce of one word, then a synchronize) and timed
with events; the figure is the median replay / ops-per-graph, rank 0's as `us`, the slowest
rank's as `us_max_rank`. Every impl's outputs are compared with tpfuse's on the same inputs
(fresh, not the timed buffers): `max_abs_diff` (the largest difference in norm_out and
residual_out, and for the FP8 ops in the FP8 values and scales), `bitwise_equal` (every output
identical in every bit).

FlashInfer is a benchmark dependency only: scripts/prepare-flashinfer.sh makes the bundle the GPU
machine uses. Without it the FlashInfer impls are left out and the run says so.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_path  # noqa: E402

BUFFER_SETS = 4
WARMUP_REPLAYS = 3
EPS = 1e-6
DTYPE = torch.bfloat16
MAX_TOKENS = 32768  # tpfuse-bench's GPU limit
# The FP8 ops: tpfuse-bench's op name -> (tpfuse's quant, the FlashInfer pattern that keeps the
# norm as well, the one that writes the FP8 output alone). The static scale puts the norms of
# random_sets' values well inside E4M3's range.
FP8_OPS = {
    "allreduce_add_rmsnorm_fp8": ("static", "kARResidualRMSNormOutFP8Quant",
                                  "kARResidualRMSNormFP8Quant"),
    "allreduce_add_rmsnorm_fp8_token": ("per_token", "kARResidualRMSNormOutDynamicFP8Quant",
                                        "kARResidualRMSNormDynamicFP8Quant"),
}
STATIC_SCALE = 0.02


def parse_list(text, flag):
    items = text.split(",")
    if any(item.strip() == "" for item in items):
        raise SystemExit(f"peers.py: {flag} has an empty item in {text!r}")
    try:
        values = [int(item) for item in items]
    except ValueError:
        raise SystemExit(f"peers.py: {flag} expects comma-separated integers, got {text!r}")
    if any(v < 1 for v in values):
        raise SystemExit(f"peers.py: {flag} values must be >= 1, got {text!r}")
    return values


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="3072,7168")
    parser.add_argument("--tokens", default=",".join(str(1 << i) for i in range(14)))
    parser.add_argument("--ops-per-graph", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--results", default="",
                        help="a tpfuse-bench results file of this run: the records are added to it")
    parser.add_argument("--skip", default="", help="impls to leave out, comma-separated")
    parser.add_argument("--skip-fp8", action="store_true",
                        help="leave out the FP8 ops (allreduce_add_rmsnorm_fp8, _fp8_token)")
    parser.add_argument("--with-compile", action="store_true",
                        help="also the local add + RMSNorm compiled by Inductor (a compile per "
                             "shape: minutes on a fresh machine)")
    results_path.add_arguments(parser)
    args = parser.parse_args(argv)
    args.hidden = parse_list(args.hidden, "--hidden")
    args.tokens = parse_list(args.tokens, "--tokens")
    if max(args.tokens) > MAX_TOKENS:
        raise SystemExit(f"peers.py: --tokens {max(args.tokens)}: at most {MAX_TOKENS}")
    if any(h % 8 for h in args.hidden):
        raise SystemExit("peers.py: --hidden values must be multiples of 8")
    if args.ops_per_graph < 1 or args.replays < 1:
        raise SystemExit("peers.py: --ops-per-graph and --replays must be >= 1")
    if args.results and (args.out or args.out_dir):
        raise SystemExit("peers.py: --results excludes --out and --out-dir")
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def nvlink_off():
    # NVLink multicast stays off for every library in the process, before any of them loads.
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")


def import_flashinfer():
    """(module, None) or (None, why not)."""
    try:
        import flashinfer  # noqa: F401
        import flashinfer.comm  # noqa: F401
        import flashinfer.norm  # noqa: F401

        return flashinfer, None
    except Exception as error:  # ImportError, or a missing optional dependency inside it
        return None, f"{type(error).__name__}: {error}"


class Timer:
    """tpfuse-bench's method for one rank: graph of back-to-back ops, replays started together."""

    def __init__(self, device, ops_per_graph, replays, barrier):
        self.device = device
        self.ops = ops_per_graph
        self.replays = replays
        self.barrier = barrier
        self.stream = torch.cuda.Stream(device)

    def measure(self, enqueue):
        """enqueue(set_index) queues one op on the current stream. Returns µs per op (median)."""
        with torch.cuda.stream(self.stream):
            enqueue(0)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            for i in range(self.ops):
                enqueue(i % BUFFER_SETS)
        self.barrier()
        for _ in range(WARMUP_REPLAYS):
            graph.replay()
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.replays):
            self.barrier()
            with torch.cuda.stream(self.stream):
                start.record()
                graph.replay()
                stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) * 1000.0 / self.ops)
        del graph
        return statistics.median(samples)


def random_sets(tokens, hidden, device, seed):
    """BUFFER_SETS sets of (input, residual, residual_out, norm_out) and gamma, seeded per rank."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def uniform(shape, low, high):
        return (torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
                * (high - low) + low).to(DTYPE)

    sets = []
    for _ in range(BUFFER_SETS):
        sets.append({
            "input": uniform((tokens, hidden), -1, 1),
            "residual": uniform((tokens, hidden), -1, 1),
            "residual_out": uniform((tokens, hidden), -1, 1),
            "norm_out": uniform((tokens, hidden), -1, 1),
        })
    gamma = uniform((hidden,), 0.5, 1.5)
    return sets, gamma


def compare(outputs, reference):
    """(max |difference| over norm_out and residual_out, whether every bit is equal)."""
    worst, equal = 0.0, True
    for got, want in zip(outputs, reference):
        if got.shape != want.shape or got.dtype != want.dtype:
            return float("nan"), False
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        equal = equal and torch.equal(got.reshape(-1).view(torch.uint8),
                                      want.reshape(-1).view(torch.uint8))
    return worst, equal


# ---- The collective impls (one process per GPU) -------------------------------------------------


class TpfuseTorch:
    """tpfuse's fused op from torch, in place as engines call it (residual <- sum + residual,
    input <- norm), the selector's choice."""

    name = "tpfuse_torch"
    op = "allreduce_add_rmsnorm"

    def __init__(self, context):
        import tpfuse

        self.tpfuse = tpfuse
        self.team = context["team"]

    def prepare(self, tokens, hidden):
        pass

    def call(self, s, gamma):
        self.tpfuse.allreduce_add_rmsnorm_(self.team, s["input"], s["residual"], gamma, EPS)
        return s["input"], s["residual"]


class TpfuseTorchFp8(TpfuseTorch):
    """tpfuse's FP8 op from torch, in place (input <- the bf16 norm, which a MoE router reads),
    returning the FP8 bytes (and the per-token scales); with keep_norm False no bf16 norm is
    written (the outputs: the residual, the FP8 bytes and the scales)."""

    def __init__(self, context, op, keep_norm=True):
        super().__init__(context)
        self.op = op
        self.keep_norm = keep_norm
        self.name = "tpfuse_torch" if keep_norm else "tpfuse_torch_no_norm"
        self.quant = FP8_OPS[op][0]
        self.scale = torch.full((1,), STATIC_SCALE, dtype=torch.float32, device=context["device"])

    def call(self, s, gamma):
        static = self.quant == "static"
        q, scales = self.tpfuse.allreduce_add_rmsnorm_fp8_(
            self.team, s["input"], s["residual"], gamma, EPS, self.quant,
            scale=self.scale if static else None, keep_norm=self.keep_norm)
        norm = (s["input"],) if self.keep_norm else ()
        return norm + (s["residual"], q) + (() if static else (scales.reshape(-1, 1),))


class SymmMemThenLocal:
    """torch's symmetric-memory all-reduce of the input (kept in a symmetric buffer, as a model
    whose GEMM wrote it there), then tpfuse's local add + RMSNorm in place on the sum."""

    op = "allreduce_add_rmsnorm"

    def __init__(self, context, algorithm):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.algorithm = algorithm
        self.name = f"symm_mem_{algorithm}+tpfuse_local"
        self.group_name = context["group_name"]
        self.local = context["local_team"]
        self.device = context["device"]
        self.buffers = {}

    def prepare(self, tokens, hidden):
        self.buffers = {}

    def bind(self, sets):
        # Symmetric buffers are made (a collective rendezvous) before any capture, in the same
        # order on every rank; each holds its set's input.
        for s in sets:
            buffer = self.symm_mem.empty(s["input"].shape, dtype=DTYPE, device=self.device)
            self.symm_mem.rendezvous(buffer, self.group_name)
            buffer.copy_(s["input"])
            self.buffers[id(s["input"])] = (buffer, torch.empty_like(s["input"]))

    def call(self, s, gamma):
        import tpfuse

        buffer, total = self.buffers[id(s["input"])]
        if self.algorithm == "oneshot":
            torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", self.group_name, total)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(buffer, "sum", self.group_name, total)
        # In place, as an engine's fused add + RMSNorm: residual <- sum + residual, total <- norm.
        tpfuse.allreduce_add_rmsnorm_(self.local, total, s["residual"], gamma, EPS)
        return total, s["residual"]


class FlashInferFusion:
    """FlashInfer's fused all-reduce + residual add + RMSNorm (TensorRT-LLM's Lamport kernels),
    called as vLLM calls it: in place (norm into the input, the sum into the residual), fp32
    accumulation, PDL, the workspace rendezvous over a gloo group."""

    op = "allreduce_add_rmsnorm"

    def __init__(self, context, mode):
        self.fi = context["flashinfer"]
        self.mode = mode  # "oneshot", "twoshot", "auto"
        self.name = f"flashinfer_{mode}"
        self.rank = context["rank"]
        self.world = context["world"]
        self.group = context["cpu_group"]
        self.device = context["device"]
        self.workspace = None
        self.shape = None

    def prepare(self, tokens, hidden):
        # One workspace per width, sized for the largest token count of the run.
        if self.shape == hidden:
            return
        self.close()
        from flashinfer.comm import create_allreduce_fusion_workspace

        self.workspace = create_allreduce_fusion_workspace(
            backend="trtllm", world_size=self.world, rank=self.rank,
            max_token_num=PeersRun.max_tokens, hidden_dim=hidden, dtype=DTYPE,
            group=self.group)
        # Not written by this pattern, but allocated on every call unless given.
        self.scratch = torch.empty((PeersRun.max_tokens, hidden), dtype=DTYPE, device=self.device)
        self.shape = hidden

    def close(self):
        if self.workspace is not None and hasattr(self.workspace, "destroy"):
            self.workspace.destroy()
        self.workspace = None
        self.shape = None

    def call(self, s, gamma):
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

        if self.mode == "twoshot" and s["input"].shape[0] <= self.world:
            raise ValueError("FlashInfer's two-shot needs more tokens than ranks")

        use_oneshot = {"oneshot": True, "twoshot": False, "auto": None}[self.mode]
        allreduce_fusion(
            input=s["input"], workspace=self.workspace,
            pattern=AllReduceFusionPattern.kARResidualRMSNorm, launch_with_pdl=True,
            trigger_completion_at_end=True, output=self.scratch[: s["input"].shape[0]],
            residual_in=s["residual"],
            residual_out=s["residual"], norm_out=s["input"], rms_gamma=gamma, rms_eps=EPS,
            use_oneshot=use_oneshot, fp32_acc=True)
        return s["input"], s["residual"]


class FlashInferFusionFp8(FlashInferFusion):
    """FlashInfer's fused all-reduce + residual add + RMSNorm + FP8 output, the pattern that also
    keeps the bf16 norm (in place into the input, as vLLM calls it), or with keep_norm False the
    one that writes the FP8 output alone: a static scale (scale_factor, a device scalar) or a
    dynamic scale per token (scale_out [tokens, 1])."""

    def __init__(self, context, mode, op, keep_norm=True):
        super().__init__(context, mode)
        self.op = op
        self.keep_norm = keep_norm
        if not keep_norm:
            self.name += "_no_norm"
        self.quant, kept, alone = FP8_OPS[op]
        self.pattern_name = kept if keep_norm else alone
        self.scale = torch.full((1,), STATIC_SCALE, dtype=torch.float32, device=self.device)

    def prepare(self, tokens, hidden):
        if self.shape == hidden:
            return
        super().prepare(tokens, hidden)
        self.quant_out = torch.empty((PeersRun.max_tokens, hidden), dtype=torch.float8_e4m3fn,
                                     device=self.device)
        self.scale_out = torch.empty((PeersRun.max_tokens, 1), dtype=torch.float32,
                                     device=self.device)

    def call(self, s, gamma):
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

        tokens = s["input"].shape[0]
        if self.mode == "twoshot" and tokens <= self.world:
            raise ValueError("FlashInfer's two-shot needs more tokens than ranks")
        static = self.quant == "static"
        quant_out, scale_out = self.quant_out[:tokens], self.scale_out[:tokens]
        use_oneshot = {"oneshot": True, "twoshot": False, "auto": None}[self.mode]
        allreduce_fusion(
            input=s["input"], workspace=self.workspace,
            pattern=getattr(AllReduceFusionPattern, self.pattern_name), launch_with_pdl=True,
            trigger_completion_at_end=True, output=self.scratch[:tokens],
            residual_in=s["residual"], residual_out=s["residual"],
            norm_out=s["input"] if self.keep_norm else None, quant_out=quant_out,
            scale_out=None if static else scale_out, rms_gamma=gamma, rms_eps=EPS,
            scale_factor=self.scale if static else None, use_oneshot=use_oneshot, fp32_acc=True)
        norm = (s["input"],) if self.keep_norm else ()
        return norm + (s["residual"], quant_out) + (() if static else (scale_out,))


MOE_TOPK = 8  # MiniMax-M2's
MOE_MAX_TOKENS = 1024


class MoeInputs:
    """Each buffer set's MoE inputs, made at bind from the rank and the set's place in the list (so
    that every impl sees the same values): expert rows [tokens, MOE_TOPK, hidden] and bf16 routing
    weights [tokens, MOE_TOPK] (the dtype FlashInfer's kernel reads them in)."""

    def __init__(self, device, rank):
        self.device, self.rank = device, rank
        self.by_input = {}

    def bind(self, sets):
        self.by_input = {}
        for index, s in enumerate(sets):
            tokens, hidden = s["input"].shape
            if tokens > MOE_MAX_TOKENS:
                raise ValueError(f"the MoE impls are measured up to {MOE_MAX_TOKENS} tokens")
            generator = torch.Generator(device=self.device).manual_seed(
                1000 * self.rank + 7919 * index + tokens * hidden)
            rows = (torch.rand((tokens, MOE_TOPK, hidden), generator=generator,
                               device=self.device) * 2 - 1).to(DTYPE)
            weights = torch.rand((tokens, MOE_TOPK), generator=generator,
                                 device=self.device).to(DTYPE)
            self.by_input[s["input"].data_ptr()] = (rows, weights)

    def of(self, s):
        return self.by_input[s["input"].data_ptr()]


class TpfuseTorchMoe(TpfuseTorch):
    """tpfuse's MoE finalize + all-reduce + add + RMSNorm from torch (out of place)."""

    op = "allreduce_moe_finalize_add_rmsnorm"

    def __init__(self, context):
        super().__init__(context)
        self.moe = MoeInputs(context["device"], context["rank"])

    def bind(self, sets):
        self.moe.bind(sets)

    def call(self, s, gamma):
        rows, weights = self.moe.of(s)
        return self.tpfuse.allreduce_moe_finalize_add_rmsnorm(
            self.team, rows, weights, s["residual"], gamma, EPS)


class FlashInferMoeFinalize(FlashInferFusion):
    """FlashInfer's MoE finalize + all-reduce + residual add + RMSNorm (TensorRT-LLM's one-shot
    kernel): its permuted expert rows are the [tokens * MOE_TOPK, hidden] view of the same rows,
    mapped by an identity index map; norm into the input, the sum into the residual."""

    op = "allreduce_moe_finalize_add_rmsnorm"

    def __init__(self, context):
        super().__init__(context, "oneshot")
        self.name = "flashinfer_moe_finalize"
        self.moe = MoeInputs(self.device, self.rank)
        self.index_map = None

    def bind(self, sets):
        self.moe.bind(sets)
        tokens = sets[0]["input"].shape[0]
        self.index_map = torch.arange(tokens * MOE_TOPK, dtype=torch.int32,
                                      device=self.device).view(tokens, MOE_TOPK)

    def call(self, s, gamma):
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

        rows, weights = self.moe.of(s)
        tokens, hidden = s["input"].shape
        allreduce_fusion(
            input=rows.view(tokens * MOE_TOPK, hidden), workspace=self.workspace,
            pattern=AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm, launch_with_pdl=True,
            residual_in=s["residual"], residual_out=s["residual"], norm_out=s["input"],
            rms_gamma=gamma, rms_eps=EPS, expanded_idx_to_permuted_idx=self.index_map,
            expert_scale_factor=weights)
        return s["input"], s["residual"]


class PeersRun:
    max_tokens = 1


def rank_main(rank, world, store_path, args, queue):
    nvlink_off()
    import torch.distributed as dist

    import tpfuse

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, device_id=device)
    word = torch.zeros(1, device=device)

    def barrier():
        dist.all_reduce(word)
        torch.cuda.synchronize(device)

    flashinfer, why_not = import_flashinfer()
    group = dist.group.WORLD
    context = {
        "rank": rank, "world": world, "device": device, "group": group,
        "cpu_group": dist.new_group(backend="gloo"),
        "group_name": group.group_name, "team": tpfuse.Team.from_group(group),
        "local_team": tpfuse.cuda_team([rank])[0], "flashinfer": flashinfer,
    }
    PeersRun.max_tokens = max(args.tokens)
    impls = [TpfuseTorch(context)]
    if flashinfer is not None:
        impls += [FlashInferFusion(context, mode) for mode in ("oneshot", "twoshot", "auto")]
    elif rank == 0:
        print(f"peers.py: FlashInfer is not importable ({why_not}): its impls are left out",
              file=sys.stderr)
    impls += [SymmMemThenLocal(context, algorithm) for algorithm in ("oneshot", "twoshot")]
    if not args.skip_fp8:
        for op in FP8_OPS:
            for keep_norm in (True, False):
                impls.append(TpfuseTorchFp8(context, op, keep_norm))
                if flashinfer is not None:
                    impls += [FlashInferFusionFp8(context, mode, op, keep_norm)
                              for mode in ("oneshot", "twoshot", "auto")]
    impls.append(TpfuseTorchMoe(context))
    if flashinfer is not None:
        impls.append(FlashInferMoeFinalize(context))
    impls = [impl for impl in impls if impl.name not in args.skip]

    timer = Timer(device, args.ops_per_graph, args.replays, barrier)
    records = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            references = {}  # op -> tpfuse_torch's outputs on the check inputs
            for impl in impls:
                failed = None
                try:
                    impl.prepare(tokens, hidden)
                    sets, gamma = random_sets(tokens, hidden, device, seed=1000 * rank + 7)
                    check_sets, _ = random_sets(tokens, hidden, device, seed=1000 * rank + 99)
                    check = check_sets[0]
                    if hasattr(impl, "bind"):
                        impl.bind(check_sets[:1] + sets)
                    outputs = [t.clone() for t in impl.call(check, gamma)]
                    torch.cuda.synchronize(device)
                    us = timer.measure(lambda i: impl.call(sets[i], gamma))
                except Exception as error:  # an impl that cannot run this shape: said, not hidden
                    failed = f"{type(error).__name__}: {error}"
                    us, outputs = float("nan"), None
                    traceback.print_exc(file=sys.stderr)
                # Every rank agrees on whether an impl ran before the next one starts.
                flags = torch.tensor([0.0 if failed is None else 1.0], device=device)
                dist.all_reduce(flags)
                if flags.item() > 0 and failed is None:
                    failed = "failed on another rank"
                record = {"op": impl.op, "impl": impl.name, "hidden": hidden,
                          "tokens": tokens, "world_size": world, "us": us}
                if impl.name.startswith("flashinfer"):
                    record["pdl"] = True
                if failed is not None:
                    record["error"] = failed
                elif impl.name == "tpfuse_torch":
                    references[impl.op] = outputs
                    record["chosen"] = context["team"].choose(tokens, hidden, DTYPE)
                elif impl.op in references:
                    # An impl without the bf16 norm against the reference's other outputs.
                    reference = references[impl.op][0 if getattr(impl, "keep_norm", True) else 1:]
                    record["max_abs_diff"], record["bitwise_equal"] = compare(outputs, reference)
                records.append(record)
                if rank == 0:
                    print(f"peers: hidden {hidden} tokens {tokens} {impl.op} {impl.name}: "
                          f"{us:.2f} us" + (f" ({failed})" if failed else ""), file=sys.stderr)
    for impl in impls:
        if hasattr(impl, "close"):
            impl.close()
    # Rank 0 keeps every rank's figures: the slowest rank's median goes into its record.
    gathered = [None] * world
    dist.all_gather_object(gathered, [r["us"] for r in records])
    if rank == 0:
        for i, record in enumerate(records):
            values = [g[i] for g in gathered if g[i] == g[i]]
            if values:
                record["us_max_rank"] = max(values)
        queue.put(records)
    context["team"].close()
    context["local_team"].close()
    dist.destroy_process_group()


# ---- The local kernels (GPU 0) ------------------------------------------------------------------


def local_records(args):
    """op add_rmsnorm, in place, on GPU 0: FlashInfer's, tpfuse's (a one-rank team), Inductor's."""
    import tpfuse

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    flashinfer, why_not = import_flashinfer()
    solo = tpfuse.cuda_team([0])[0]
    timer = Timer(device, args.ops_per_graph, args.replays, lambda: None)

    def torch_add_rmsnorm(x, residual, weight):
        h = x.float() + residual.float()
        residual.copy_(h.to(x.dtype))
        r = residual.float()
        x.copy_((r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight)

    impls = {
        "tpfuse_one_rank": lambda x, r, w: tpfuse.allreduce_add_rmsnorm_(solo, x, r, w, EPS),
    }
    if args.with_compile:
        # One graph per shape (as a model compiled for its decode shapes): allow them all.
        torch._dynamo.config.cache_size_limit = max(64, 2 * len(args.hidden) * len(args.tokens))
        impls["torch_compile"] = torch.compile(torch_add_rmsnorm, dynamic=False)
    if flashinfer is not None:
        from flashinfer.norm import fused_add_rmsnorm

        impls["flashinfer_fused_add_rmsnorm"] = (
            lambda x, r, w: fused_add_rmsnorm(x, r, w, EPS, enable_pdl=True))
    else:
        print(f"peers.py: FlashInfer is not importable ({why_not}): its local kernel is left out",
              file=sys.stderr)
    records = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            reference = None
            for name, fn in impls.items():
                if name in args.skip:
                    continue
                record = {"op": "add_rmsnorm", "impl": name, "hidden": hidden, "tokens": tokens,
                          "world_size": 1}
                try:
                    sets, gamma = random_sets(tokens, hidden, device, seed=5)
                    check_sets, _ = random_sets(tokens, hidden, device, seed=6)
                    x, r = check_sets[0]["input"], check_sets[0]["residual"]
                    fn(x, r, gamma)
                    torch.cuda.synchronize(device)
                    record["us"] = timer.measure(
                        lambda i: fn(sets[i]["input"], sets[i]["residual"], gamma))
                    if name == "tpfuse_one_rank":
                        reference = (x, r)
                    elif reference is not None:
                        record["max_abs_diff"], record["bitwise_equal"] = compare((x, r),
                                                                                  reference)
                    if name.startswith("flashinfer") or name == "tpfuse_one_rank":
                        record["pdl"] = name.startswith("flashinfer") or (
                            os.environ.get("TPFUSE_DISABLE_PDL", "0") in ("", "0"))
                except Exception as error:
                    record["us"] = float("nan")
                    record["error"] = f"{type(error).__name__}: {error}"
                    traceback.print_exc(file=sys.stderr)
                records.append(record)
                print(f"peers: local hidden {hidden} tokens {tokens} {name}: {record['us']:.2f} us",
                      file=sys.stderr)
    solo.close()
    return records


# ---- The run ------------------------------------------------------------------------------------


def run_fields(args, results):
    """What every record of the run shares: taken from the tpfuse-bench file when there is one."""
    fields = {}
    for record in results:
        if record.get("op") != "floor":
            for key in ("gpu", "driver", "cuda", "nccl", "commit", "backend"):
                if key in record:
                    fields[key] = record[key]
            break
    fields.setdefault("gpu", torch.cuda.get_device_name(0))
    fields.setdefault("cuda", torch.version.cuda or "")
    fields.setdefault("nccl", ".".join(str(v) for v in torch.cuda.nccl.version()))
    fields.setdefault("commit", results_path.commit())
    fields.setdefault("backend", "cuda")
    fields["dtype"] = "bf16"
    fields["torch"] = torch.__version__
    fields["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return fields


def main(argv=None):
    args = parse_args(argv)
    nvlink_off()
    if not torch.cuda.is_available():
        raise SystemExit("peers.py: needs a CUDA GPU (the peers are GPU kernels)")
    world = min(torch.cuda.device_count(), 8)
    results = []
    if args.results:
        with open(args.results) as file:
            results = json.load(file)
    method = (f"cuda-graph of {args.ops_per_graph} ops, median of {args.replays} replays, "
              "from torch (bench/peers.py)")
    records = []
    if world >= 2:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        queue = context.SimpleQueue()
        store = os.path.join(tempfile.mkdtemp(), "store")
        processes = [context.Process(target=rank_main, args=(r, world, store, args, queue))
                     for r in range(world)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if any(p.exitcode != 0 for p in processes):
            raise SystemExit("peers.py: a rank process failed (its error is above)")
        records += queue.get()
        method_collective = method + ", one process per GPU"
        for record in records:
            record["method"] = method_collective
    else:
        print("peers.py: one GPU: the collectives need two; measuring the local kernels",
              file=sys.stderr)
    for record in local_records(args):
        record["method"] = method + ", GPU 0"
        records.append(record)

    fields = run_fields(args, results)
    records = [{**record, **{k: v for k, v in fields.items() if k not in record}}
               for record in records]
    # JSON has no NaN: a figure not measured is null.
    for record in records:
        for key in ("us", "max_abs_diff"):
            if key in record and record[key] != record[key]:
                record[key] = None
    if args.results:
        path = args.results
        results += records
    else:
        path = results_path.reserve(args, fields["gpu"], world, fields["commit"], "peers")
        results = records
    if path:
        with open(path, "w") as file:
            file.write("[\n" + ",\n".join("  " + json.dumps(r) for r in results) + "\n]\n")
        print(f"peers.py: wrote {len(records)} records to {path}")
    for record in records:
        extra = ""
        if "bitwise_equal" in record and record["max_abs_diff"] is not None:
            extra = (f"  vs tpfuse: max |diff| {record['max_abs_diff']:.3g}"
                     f"{', same bits' if record['bitwise_equal'] else ''}")
        us = "-" if record["us"] is None else f"{record['us']:.2f}"
        print(f"{record['op']:34s} {record['impl']:34s} hidden {record['hidden']:5d} "
              f"tokens {record['tokens']:5d}  {us:>8s} us{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
