"""bench/e2e/transformers_decode.py's CPU smoke run: transformers' Llama, tensor-parallel by its
own plan over gloo at world 2, its KV-cached decode step (a StaticCache after a prefill) compiled
with tpfuse's passes: every all-reduce + add + RMSNorm site of the decode graph rewritten, its
logits close to the eager model's and the same bits on both ranks. The timings are the GPU run's
business (scripts/gpu-check.sh's transformers step); here they only have to exist."""

import importlib.util
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "e2e"))

import transformers_decode  # noqa: E402

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
LAYERS = 2


@unittest.skipUnless(HAVE_TRANSFORMERS, "needs transformers 5.17.0 (.ci/run installs it)")
class TransformersDecodeOnCpu(unittest.TestCase):
    def test_the_cached_decode_step_has_every_site_fused(self):
        out = os.path.join(tempfile.mkdtemp(), "transformers-decode.json")
        status = transformers_decode.main([
            "--device", "cpu", "--world", "2", "--models", "llama", "--modes", "eager,tpfuse",
            "--batches", "1", "--context", "8", "--steps", "2", "--warmup", "1",
            "--layers", str(LAYERS), "--hidden", "256", "--intermediate", "512", "--heads", "8",
            "--kv-heads", "4", "--head-dim", "32", "--vocab", "1000", "--out", out,
        ])
        self.assertEqual(status, 0)
        with open(out) as file:
            results = json.load(file)
        self.assertEqual(results["failures"], [])
        records = {r["mode"]: r for r in results["records"]}
        self.assertEqual(set(records), {"eager", "tpfuse"})
        for record in records.values():
            self.assertNotIn("error", record)
            self.assertGreater(record["ms_per_step"], 0)
            self.assertTrue(record["logits_identical_across_ranks"], record["mode"])
            self.assertTrue(record["first_step_repeats_bitwise"], record["mode"])
        fused = records["tpfuse"]
        # One decode graph, with the cache written in it, and both sites of every layer fused.
        self.assertEqual(fused["graphs_compiled_after_timing"], 1)
        self.assertEqual(fused["cache_writes"], 3 * LAYERS)
        self.assertEqual(fused["sites_expected"], 2 * LAYERS)
        self.assertEqual(fused["sites_rewritten"], 2 * LAYERS)
        self.assertEqual(fused["pass_rewrites"], {"allreduce_add_rmsnorm": 2 * LAYERS})
        self.assertEqual(fused["all_reduces_before"], 2 * LAYERS)
        self.assertEqual(fused["all_reduces_left"], 0)
        self.assertTrue(fused["logits_close_to_eager"])
        self.assertGreater(fused["logits_rel_err_vs_eager"], 0.0)  # really fused


if __name__ == "__main__":
    unittest.main()
