"""Models written by others as the passes' clients: HF transformers' own Llama, Qwen3 and
MiniMax-M2 modeling code, made tensor-parallel by transformers' own plans (``tp_plan``,
``apply_tensor_parallelism`` over a gloo device mesh), two processes, tiny configs with random
weights. Each rank compiles the model with tpfuse's passes on its ``Team.from_group`` team (the CPU
backend over shared memory) and checks that every all-reduce + add + RMSNorm site of every layer
was rewritten (none left), and that the logits match the uncompiled tensor-parallel model.

What transformers 5.17's plans give (and what this test takes as it is):
- Llama: two sites a layer (attention output, MLP output), residual first, weight on the left.
- Qwen3: the same; its per-head q/k norms are local. Its plan marks them
  ``replicated_with_grad_allreduce``, a backward hook that breaks Dynamo's graph at every call, so
  the all-reduce and its norm land in different graphs: the test's plan leaves those two entries
  out (for inference the forward is the same).
- MiniMax-M2: the MoE output is all-reduced flat ([tokens, hidden]) and reshaped before the add
  (the passes' reshaped form). Its q/k norm over the full width is served by gathering q, k and v
  and running attention replicated: there is no variance all-reduce for the QK pass to fuse.
KV heads fewer than ranks are not supported by transformers' plans (they split a head), so every
config here has KV heads >= the world size.
"""

import copy
import importlib.util
import os
import sys
import traceback
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned_ranks import run_ranks  # noqa: E402

WORLD = 2
LAYERS = 2
PEER_TIMEOUT_SECONDS = 600.0
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _config(name):
    import transformers

    common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  dtype=torch.bfloat16)
    if name == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(head_dim=32, **common)
    if name == "minimax_m2":
        return transformers.MiniMaxM2ForCausalLM, transformers.MiniMaxM2Config(
            head_dim=32, num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                             "partial_rotary_factor": 0.5},
            **common)
    raise ValueError(name)


def _tensor_parallel(name, cls, config, world):
    """The model sharded by transformers' own plan on a mesh of `world` CPU ranks, built as the
    decode benchmark builds it (bench/e2e/transformers_decode.py)."""
    from transformers.distributed.utils import initialize_tensor_parallelism

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "bench", "e2e"))
    import transformers_decode

    _, mesh = initialize_tensor_parallelism("auto", tp_size=world)
    model = transformers_decode.tensor_parallel(name, cls, config, mesh, torch.device("cpu"))
    return model, mesh


def _check_model(name, team, rank, world):
    import tpfuse.passes as passes

    cls, config = _config(name)
    model, mesh = _tensor_parallel(name, cls, config, world)
    tokens = torch.randint(0, config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        eager = model(tokens, use_cache=False).logits
        fusion = passes.install(team, mesh.get_group())
        try:
            torch._dynamo.reset()
            compiled = torch.compile(copy.copy(model), dynamic=False)
            got = compiled(tokens, use_cache=False).logits
        finally:
            passes.uninstall()
    sites = 2 * LAYERS
    assert fusion.stats["allreduce_add_rmsnorm"] == sites, (name, fusion.stats)
    assert len(fusion.graphs) == 1, (name, len(fusion.graphs))
    (graph,) = fusion.graphs
    assert graph["before"].count("_c10d_functional.all_reduce.default") == sites, name
    assert "_c10d_functional.all_reduce.default" not in graph["after"], (name, graph["after"])
    assert graph["after"].count("tpfuse.allreduce_add_rmsnorm.default") == sites, name
    # The fused op rounds once where the unfused model rounds twice: a few bf16 steps.
    torch.testing.assert_close(got.float(), eager.float(), atol=5e-2, rtol=5e-2, msg=name)
    # Every rank's compiled logits are the same bits (as int32: gloo gathers no int16).
    import torch.distributed as dist

    bits = got.contiguous().view(torch.int16).to(torch.int32)
    gathered = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(gathered, bits, group=mesh.get_group())
    for other, theirs in enumerate(gathered):
        assert torch.equal(theirs, gathered[0]), f"{name}: rank {other}'s logits differ from rank 0's"


def _rank_main(rank, world, store_path, failures):
    try:
        import torch.distributed as dist

        import tpfuse

        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        torch.set_num_threads(1)
        # Every compile runs the passes (a graph-cache hit would skip them, and their counts);
        # compiled kernels stay cached, so ranks that generate the same code build it once.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        # A generous peer timeout: each rank compiles every model before its first call in it, and
        # on a loaded machine one rank reached Inductor 23 s after the other (CI, with the default
        # 10 s: "rank 1: a call timed out waiting for rank 0"). A compiling peer is not a dead one;
        # the timeout itself is tested with short ones elsewhere.
        team = tpfuse.Team.from_group(peer_timeout_seconds=PEER_TIMEOUT_SECONDS)
        for name in ("llama", "qwen3", "minimax_m2"):
            _check_model(name, team, rank, world)
        team.close()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent
        failures.put(f"rank {rank}:\n{traceback.format_exc()}")


@unittest.skipUnless(HAVE_TRANSFORMERS, "needs transformers 5.17.0 (.ci/run installs it)")
class TransformersModels(unittest.TestCase):
    def test_every_site_of_llama_qwen3_and_minimax_m2_is_fused(self):
        import transformers

        self.assertEqual(transformers.__version__, "5.17.0")
        run_ranks(self, _rank_main, WORLD, timeout=1100)

if __name__ == "__main__":
    unittest.main()
