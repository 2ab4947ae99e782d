"""Run-to-run reproducibility of the end-to-end model's pieces on one GPU (no collectives).

    python3 bench/e2e/determinism.py [--out PATH | --out-dir DIR]

The decode benchmark (decode.py) found that mode (a) does not repeat its own greedy tokens: this
runs each piece of a decoder layer twice on the same inputs and says which ones give other bits
the second time: the MoE's grouped GEMM, attention over the KV cache, the router's top-k, the
LM head, and a whole decode step of the layer stack (local, the all-reduces left out), with and
without torch.use_deterministic_algorithms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import Local  # noqa: E402  (also puts bench/ on the path)
import results_path  # noqa: E402
from model import Config, Decoder, KvCache, Weights, grouped_gemm_works, moe  # noqa: E402


def same(a, b) -> bool:
    return bool(torch.equal(a, b)) if a.dtype != torch.float32 else bool(
        torch.equal(a.view(torch.int32), b.view(torch.int32)))


def repeats(fn, times=20) -> dict:
    """Runs fn `times` times; how many results differ from the first, bit for bit."""
    first = fn()
    differ = sum(not same(fn(), first) for _ in range(times - 1))
    return {"runs": times, "differ_from_first": differ}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    results_path.add_arguments(parser)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="a tiny config on the CPU (smoke)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    config = Config(layers=args.layers)
    if args.cpu:
        config = Config(hidden=256, heads=4, kv_heads=2, head_dim=64, rotary_dim=32, experts=8,
                        top_k=2, expert_inter=128, vocab=512, layers=args.layers,
                        max_position=4096)
    world = 2  # one rank's shard of a TP-2 model
    weights = Weights(config, 0, world, device)
    local = weights.local
    grouped = grouped_gemm_works(device)
    results = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
               "torch": torch.__version__,
               "grouped_mm": grouped, "pieces": {}}
    generator = torch.Generator(device=device).manual_seed(5)
    w = weights.layers[0]
    for batch in (1, 8, 32, 128):
        h = torch.randn(batch, config.hidden, device=device, generator=generator).bfloat16()
        pieces = results["pieces"].setdefault(str(batch), {})
        pieces["moe"] = repeats(lambda: moe(h, w, config, grouped))
        if grouped:
            rows = torch.randn(batch * config.top_k, config.hidden, device=device,
                               generator=generator).bfloat16()
            counts = torch.zeros(config.experts, dtype=torch.int32, device=device)
            chosen = torch.randint(0, config.experts, (batch * config.top_k,), device=device,
                                   generator=generator).sort().values.to(torch.int64)
            counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))
            offsets = counts.cumsum(0, dtype=torch.int32)
            pieces["grouped_mm"] = repeats(
                lambda: torch._grouped_mm(rows, w["w13"].transpose(-2, -1), offs=offsets))
        pieces["router_topk"] = repeats(
            lambda: (h.float() @ w["router"]).sigmoid().add(w["router_bias"]).topk(config.top_k)[1])
        pieces["lm_head"] = repeats(lambda: h @ weights.lm_head.t())
        for context in (512, 4096):
            q = torch.randn(batch, local.heads, 1, config.head_dim, device=device,
                            generator=generator).bfloat16()
            k = torch.randn(batch, local.kv_heads, context, config.head_dim, device=device,
                            generator=generator).bfloat16()
            v = torch.randn_like(k)
            pieces[f"attention_ctx{context}"] = repeats(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        for batch in (1, 8):
            cache = KvCache(config, local, batch, 512, 0, device)
            # decode.py's mode (a) without its all-reduces, at world 1: a rank's own partials.
            decoder = Decoder(weights, cache, Local(None, 1), 1, grouped)
            tokens = torch.randint(0, config.vocab, (batch,), device=device, generator=generator)
            positions = torch.full((batch,), 512, dtype=torch.int64, device=device)
            slot = torch.zeros(1, dtype=torch.int64, device=device)

            def step():
                cache.reset()
                return decoder.step(tokens, positions, slot)

            key = f"decode_step_batch{batch}" + ("_deterministic" if deterministic else "")
            results["pieces"].setdefault("steps", {})[key] = repeats(step, 10)
    torch.use_deterministic_algorithms(False)
    for batch, pieces in results["pieces"].items():
        for name, outcome in pieces.items():
            print(f"{batch:>6} {name:<36} {outcome['differ_from_first']}/{outcome['runs'] - 1} "
                  f"repeats differ")
    out = results_path.reserve(args, results["device"], 1,
                               results_path.commit(), "determinism")
    if out:
        with open(out, "w") as file:
            json.dump(results, file, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
