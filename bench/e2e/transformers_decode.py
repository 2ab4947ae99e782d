"""Decode-step timing of HF transformers' own models, tensor-parallel by transformers' own plans:
eager, torch.compile, and torch.compile with tpfuse's passes.

    python3 bench/e2e/transformers_decode.py --out-dir tpfuse-results   # one process per GPU
    python3 bench/e2e/transformers_decode.py --device cpu --world 2 --layers 2 --hidden 256 \\
        --intermediate 512 --heads 8 --kv-heads 4 --head-dim 32 --experts 4 --top-k 2 \\
        --moe-intermediate 256 --vocab 1000 --context 16 --steps 3     # the CPU run (gloo)

The models are transformers' Llama, Qwen3 and MiniMax-M2 built from configs (--layers, --hidden,
... ; random weights, the same seed on every rank, norm weights not all ones) and sharded by
apply_tensor_parallelism with the models' tp_plan, as tests/python/test_transformers_cpu.py does
(Qwen3's plan without its q/k norm entries: see that test). Per (model, batch): a prefill of
--context tokens into a StaticCache (transformers' cache for torch.compile: fixed shapes, the
length a tensor, so one decode graph serves every step), then the step of one new token per
sequence is timed in each mode:

  eager     the tensor-parallel model as transformers runs it
  compiled  torch.compile(model, dynamic=False), no passes (the control)
  tpfuse    the same with tpfuse's passes installed (a team of the mesh's group)

Before each timing the cache's length goes back to --context, so every mode's first step sees
the same state: its logits are compared with eager's (tolerance: the fused op rounds once where
the unfused model rounds twice) and, gathered from every rank, across ranks bit for bit; the
first step again after the timed ones is compared with the first bit for bit (recorded, not
required: the rewound cache's later slots are masked, but not every GPU kernel repeats its bits,
as decode.py found). The tpfuse mode's records carry the passes' counts per pattern, the decode
graph's all-reduces before and after, and its writes into the cache (three a layer: keys,
values, length); every all-reduce + add + RMSNorm site (two a layer) must be rewritten.

Timing: on CUDA one decode step is captured as a CUDA graph (manually, as decode.py does, in
every mode) and replayed, the median replay is the step time; where capture fails, CUDA events
around each step (the record's "method" and "capture_error" say so). On the CPU, wall time per
step. Median of --steps after --warmup. The run exits non-zero when a check fails. Results:
a table on stdout, and one JSON with --out PATH or --out-dir DIR (bench/results_path.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# decode also puts bench/ on the path.
from decode import (  # noqa: E402
    PEER_TIMEOUT_SECONDS,
    init_rank,
    replay_times,
    run_info,
    run_ranks,
)
import results_path  # noqa: E402
from model import relative_error, tokens_per_second  # noqa: E402

MODELS = ("llama", "qwen3", "minimax_m2")
MODES = ("eager", "compiled", "tpfuse")
ALL_REDUCE = "_c10d_functional.all_reduce.default"
FUSED = "tpfuse.allreduce_add_rmsnorm.default"
# The fused op rounds the sum once where the unfused model rounds the all-reduce and the add:
# a few bf16 steps in the logits (the tolerance of tests/python/test_transformers_cpu.py).
LOGITS_TOLERANCE = dict(atol=5e-2, rtol=5e-2)


def model_config(name, args):
    """The model's class and its config at the command line's shapes."""
    import transformers

    common = dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  vocab_size=args.vocab, max_position_embeddings=args.context + 4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, dtype=torch.bfloat16)
    if name == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    if name == "minimax_m2":
        # Its intermediate_size is each expert's.
        common["intermediate_size"] = args.moe_intermediate
        return transformers.MiniMaxM2ForCausalLM, transformers.MiniMaxM2Config(
            num_local_experts=args.experts, num_experts_per_tok=args.top_k,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                             "partial_rotary_factor": 0.5},
            **common)
    raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")


def tensor_parallel(name, cls, config, mesh, device):
    """The model built from its config on `device` (the same seed on every rank, norm weights not
    all ones), then sharded by transformers' own plan on `mesh`."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    world = mesh.size()
    torch.manual_seed(1234)
    with device:
        model = cls(config).to(torch.bfloat16)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter, dtype=torch.float32))
    model.eval()
    plan = "auto"
    if name == "qwen3":
        # Its q/k norm entries add a backward hook that breaks Dynamo's graph at every call
        # (tests/python/test_transformers_cpu.py); the forward is the same without them.
        plan = {f"model.{k}": v for k, v in config.base_model_tp_plan.items()
                if "q_norm" not in k and "k_norm" not in k}
        plan.update(cls._tp_plan or {})
        model.tp_plan = plan
    model.config.distributed_config = DistributedConfig(tp_size=world, tp_plan=plan)
    model._device_mesh = mesh
    model._tp_size = world
    return apply_tensor_parallelism(model, mesh).eval()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (so that NaN equals NaN and -0 differs from +0), widened to
    int32 (gloo gathers no int16)."""
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()]).int()


class Runner:
    """One rank's part of the benchmark."""

    def __init__(self, args, rank, world, device):
        from torch.distributed.device_mesh import init_device_mesh

        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"
        self.mesh = init_device_mesh(device.type, (world,))
        self.group = self.mesh.get_group()
        self.team = None
        if "tpfuse" in args.modes:
            import tpfuse

            self.team = tpfuse.Team.from_group(self.group,
                                               peer_timeout_seconds=PEER_TIMEOUT_SECONDS)

    def run(self):
        records = []
        for name in self.args.models:
            cls, config = model_config(name, self.args)
            model = tensor_parallel(name, cls, config, self.mesh, self.device)
            for batch in self.args.batches:
                records.extend(self.run_batch(name, model, config, batch))
            del model
        if self.team is not None:
            self.team.close()
        return records

    def run_batch(self, name, model, config, batch):
        from transformers import StaticCache

        context = self.args.context
        # Room for every step any mode takes from --context (warm-up, capture, timed steps).
        cache = StaticCache(config=model.config,
                            max_cache_len=context + 2 * self.args.warmup + self.args.steps + 8)
        generator = torch.Generator().manual_seed(batch * 7919 + context)
        prompt = torch.randint(0, config.vocab_size, (batch, context), generator=generator)
        tokens = torch.randint(0, config.vocab_size, (batch, 1), generator=generator)
        prompt, tokens = prompt.to(self.device), tokens.to(self.device)
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
        records, reference = [], None
        for mode in self.args.modes:
            record = dict(model=name, mode=mode, batch=batch, context=context,
                          world=self.world, device=self.device.type, layers=self.args.layers,
                          sites_expected=2 * self.args.layers)
            try:
                logits = self.run_mode(mode, model, cache, tokens, record)
            except Exception as error:  # noqa: BLE001 -- reported, the run goes on
                record["error"] = f"{type(error).__name__}: {error}"
                if self.rank == 0:
                    traceback.print_exc()
                records.append(record)
                self.save_partial(record)
                continue
            if mode == "eager":
                reference = logits
            elif reference is not None:
                record["logits_rel_err_vs_eager"] = relative_error(logits, reference)
                record["logits_max_abs_diff_vs_eager"] = float(
                    (logits.float() - reference.float()).abs().max())
                record["logits_close_to_eager"] = bool(torch.allclose(
                    logits.float(), reference.float(), **LOGITS_TOLERANCE))
            record["logits_identical_across_ranks"] = self.identical_across_ranks(logits)
            records.append(record)
            self.save_partial(record)
        return records

    def save_partial(self, record):
        """Rank 0 appends each record to <out>.partial.jsonl as it is made and prints a line: a
        run cut short (a time limit, a hang in a later mode) keeps what it measured."""
        if self.rank != 0:
            return
        print(f"{record['model']} {record['mode']} batch {record['batch']}: "
              f"{record.get('ms_per_step', float('nan')):.3f} ms/step, sites "
              f"{record.get('sites_rewritten', '-')}/{record['sites_expected']}", flush=True)
        if self.args.out:
            with open(self.args.out + ".partial.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")

    def run_mode(self, mode, model, cache, tokens, record):
        """Times the mode's decode step; returns its first step's logits (from --context)."""
        import tpfuse.passes as passes

        step = model
        fusion = None
        if mode != "eager":
            # A fresh compile per (model, batch, mode): no graph of another mode is reused.
            torch._dynamo.reset()
            if mode == "tpfuse":
                fusion = passes.install(self.team, self.group)
            step = torch.compile(copy.copy(model), dynamic=False)
        try:
            with torch.no_grad():
                self.rewind(cache)
                begin = time.perf_counter()
                logits = step(tokens, past_key_values=cache, use_cache=True).logits.clone()
                if self.cuda:
                    torch.cuda.synchronize()
                # The compile's time, for the compiled modes.
                record["first_call_s"] = time.perf_counter() - begin
                if fusion is not None:
                    record.update(self.rewrites(fusion))
                record.update(self.measure(lambda: step(tokens, past_key_values=cache,
                                                        use_cache=True).logits, cache))
                record["tokens_per_s"] = tokens_per_second(tokens.shape[0],
                                                           record["ms_per_step"])
                if fusion is not None:
                    # Compiles after the first call (recompiles) would add graphs here.
                    record["graphs_compiled_after_timing"] = len(fusion.graphs)
                # The first step again after the timed ones: the rewound cache's later slots
                # (written by the timed steps) are masked, so the bits repeat.
                self.rewind(cache)
                again = step(tokens, past_key_values=cache, use_cache=True).logits
                record["first_step_repeats_bitwise"] = bool(torch.equal(_bits(again),
                                                                        _bits(logits)))
        finally:
            if fusion is not None:
                passes.uninstall()
        return logits

    def rewind(self, cache):
        """The cache's length back to --context (the prefill's): its later slots are masked."""
        for layer in cache.layers:
            layer.cumulative_length.fill_(self.args.context)

    @staticmethod
    def rewrites(fusion):
        """What the passes found in the graphs compiled so far (the decode step's)."""
        before = [op for graph in fusion.graphs for op in graph["before"]]
        after = [op for graph in fusion.graphs for op in graph["after"]]
        return {
            "pass_rewrites": {k: v for k, v in fusion.stats.items() if v},
            "graphs_compiled": len(fusion.graphs),
            "all_reduces_before": before.count(ALL_REDUCE),
            "all_reduces_left": after.count(ALL_REDUCE),
            "sites_rewritten": after.count(FUSED),
            # Writes into the graph's inputs: the static cache's keys, values and length, three
            # a layer, so the graph is the cached decode step's.
            "cache_writes": before.count("aten.copy_.default"),
        }

    def barrier(self):
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def measure(self, step, cache):
        self.rewind(cache)
        if not self.cuda:
            for _ in range(self.args.warmup):
                step()
            times = []
            for _ in range(self.args.steps):
                self.barrier()
                begin = time.perf_counter()
                step()
                times.append((time.perf_counter() - begin) * 1e3)
            return self.timing(times, "wall time of each step (CPU), median")
        result = {}
        if self.args.timing in ("auto", "graph"):
            try:
                return self.timing(self.replay_times(step, cache),
                                   "cuda graph of one decode step (manual capture), median of "
                                   "replays")
            except Exception as error:  # noqa: BLE001 -- the events below instead
                if self.args.timing == "graph":
                    raise
                torch.cuda.synchronize()
                result["capture_error"] = f"{type(error).__name__}: {error}"[:500]
        self.rewind(cache)
        for _ in range(self.args.warmup):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.args.steps):
            self.barrier()
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        result.update(self.timing(times, "cuda events around each step (no graph), median"))
        return result

    def replay_times(self, step, cache):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.args.warmup):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        self.rewind(cache)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        # Capture ran nothing: each replay writes the next slot from --context.
        self.rewind(cache)
        for _ in range(self.args.warmup):
            graph.replay()
        torch.cuda.synchronize()
        times = replay_times(graph, self.args.steps, self.barrier)
        del graph
        return times

    def timing(self, times, method):
        ms = statistics.median(times)
        return {"ms_per_step": ms, "ms_per_step_min": min(times), "steps": len(times),
                "warmup": self.args.warmup, "method": method}

    def identical_across_ranks(self, logits):
        """Whether every rank's logits have rank 0's bits (all ranks gather; each answers)."""
        import torch.distributed as dist

        bits = _bits(logits)
        gathered = [torch.empty_like(bits) for _ in range(self.world)]
        dist.all_gather(gathered, bits, group=self.group)
        return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _rank_main(rank, world, args, store_path, queue):
    try:
        import torch.distributed as dist

        # What transformers' tensor-parallel helpers read of a torchrun launch.
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        cpu = args.device == "cpu"
        if cpu:
            # The ranks share the host's cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = init_rank(rank, world, cpu, store_path)
        # Every compile runs the passes (a graph-cache hit would skip them, and their counts);
        # compiled kernels stay cached, so ranks that generate the same code build it once.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        records = Runner(args, rank, world, device).run()
        queue.put((rank, records, None))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent
        queue.put((rank, None, traceback.format_exc()))


def failures(records):
    """What the run promised and did not hold: each a line."""
    found = []
    for r in records:
        where = f"{r['model']} {r['mode']} batch {r['batch']}"
        if "error" in r:
            found.append(f"{where}: {r['error']}")
            continue
        if r["mode"] == "tpfuse":
            if r["sites_rewritten"] != r["sites_expected"] or r["all_reduces_left"]:
                found.append(f"{where}: {r['sites_rewritten']} of {r['sites_expected']} sites "
                             f"rewritten, {r['all_reduces_left']} all-reduces left "
                             f"(rewrites {r['pass_rewrites']}, {r['graphs_compiled']} graphs)")
            if "logits_close_to_eager" not in r:
                found.append(f"{where}: no eager logits to compare with (run mode eager too)")
            elif not r["logits_close_to_eager"]:
                found.append(f"{where}: logits differ from eager's by up to "
                             f"{r['logits_max_abs_diff_vs_eager']}")
            if not r["logits_identical_across_ranks"]:
                found.append(f"{where}: the ranks' logits differ")
    return found


def print_table(records):
    """A line per record; 'vs eager' and 'vs comp.': the step's speed-up over those modes."""
    step_ms = {(r["model"], r["batch"], r["mode"]): r["ms_per_step"] for r in records
               if "ms_per_step" in r}
    print(f"{'model':>10} {'mode':>8} {'batch':>5} {'ctx':>5} {'ms/step':>9} {'tok/s':>9} "
          f"{'vs eager':>8} {'vs comp.':>8} {'sites':>7} {'logit err':>9} {'ranks=':>6}  method")
    for r in records:
        if "error" in r:
            print(f"{r['model']:>10} {r['mode']:>8} {r['batch']:>5} {r['context']:>5}  "
                  f"error: {r['error'][:80]}")
            continue
        speedups = []
        for base_mode in ("eager", "compiled"):
            base = step_ms.get((r["model"], r["batch"], base_mode))
            speedups.append(f"{base / r['ms_per_step']:8.2f}" if base else f"{'-':>8}")
        sites = (f"{r['sites_rewritten']}/{r['sites_expected']}" if "sites_rewritten" in r
                 else "-")
        err = r.get("logits_rel_err_vs_eager")
        print(f"{r['model']:>10} {r['mode']:>8} {r['batch']:>5} {r['context']:>5} "
              f"{r['ms_per_step']:9.3f} {r['tokens_per_s']:9.1f} {' '.join(speedups)} {sites:>7} "
              f"{format(err, '9.2e') if err is not None else '-':>9} "
              f"{'yes' if r['logits_identical_across_ranks'] else 'NO':>6}  "
              f"{r['method'].split(',')[0]}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    names = lambda text: text.split(",")  # noqa: E731
    parser.add_argument("--models", type=names, default=list(MODELS))
    parser.add_argument("--modes", type=names, default=list(MODES))
    parser.add_argument("--batches", type=ints, default=[1, 8])
    parser.add_argument("--context", type=int, default=512, help="prefill tokens per sequence")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda (NCCL) when there are GPUs, --world of them at least; "
                             "else cpu (gloo)")
    parser.add_argument("--world", type=int, default=0,
                        help="ranks, one process each (default: every GPU; on the CPU, 2)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps (the median)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timing", choices=("auto", "graph", "events"), default="auto",
                        help="CUDA: a captured step replayed (graph), CUDA events around each "
                             "step (events), or the graph where capture works (auto)")
    shapes = parser.add_argument_group("model shapes (every model; the MoE ones MiniMax-M2's)")
    shapes.add_argument("--layers", type=int, default=4)
    shapes.add_argument("--hidden", type=int, default=4096)
    shapes.add_argument("--intermediate", type=int, default=12288)
    shapes.add_argument("--heads", type=int, default=32)
    shapes.add_argument("--kv-heads", type=int, default=8)
    shapes.add_argument("--head-dim", type=int, default=128)
    shapes.add_argument("--vocab", type=int, default=32000)
    shapes.add_argument("--experts", type=int, default=32)
    shapes.add_argument("--top-k", type=int, default=8)
    shapes.add_argument("--moe-intermediate", type=int, default=1536)
    results_path.add_arguments(parser)
    args = parser.parse_args(argv)
    for kind, chosen, known in (("models", args.models, MODELS), ("modes", args.modes, MODES)):
        for value in chosen:
            if value not in known:
                parser.error(f"--{kind}: unknown {value!r} (known: {', '.join(known)})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus and args.world <= gpus else "cpu"
    if args.device == "cuda" and gpus == 0:
        parser.error("--device cuda: no CUDA GPUs")
    args.world = args.world or (gpus if args.device == "cuda" else 2)
    if args.device == "cuda" and args.world > gpus:
        parser.error(f"--world {args.world}: {gpus} GPUs")
    if args.kv_heads % args.world or args.heads % args.world:
        # transformers' plans split heads whole (a KV head fewer than ranks would be cut).
        parser.error(f"--heads and --kv-heads must be multiples of --world {args.world}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import transformers

    cpu = args.device == "cpu"
    info = dict(run_info(cpu, args.world), transformers=transformers.__version__,
                models=args.models, modes=args.modes,
                shapes={k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                      "kv_heads", "head_dim", "vocab", "experts",
                                                      "top_k", "moe_intermediate")})
    args.out = results_path.reserve(args, info["device"], args.world, info["commit"],
                                    "transformers-decode")
    records = run_ranks(_rank_main, args.world, args)
    if records is None:
        if args.out and os.path.getsize(args.out) == 0:
            os.remove(args.out)
        return 1
    for record in records:
        record["commit"] = info["commit"]
    print_table(records)
    failed = failures(records)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"info": info, "failures": failed, "records": records}, file, indent=1)
        print(f"wrote {args.out}")
        if os.path.exists(args.out + ".partial.jsonl"):
            os.remove(args.out + ".partial.jsonl")
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
