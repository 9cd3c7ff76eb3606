"""On a CUDA device: FP8 weights and the FP8 KV cache give the CPU reference's tokens (fp32), stay
close to it in bf16, and keep the trained tiny model's perplexity within 1% of bf16."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from batchgen.layers.fp8_linear import Fp8Linear

pytestmark = pytest.mark.gpu

TRAINED = Path(__file__).resolve().parents[2] / "examples" / "trained-tiny"


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 200))] for _ in range(n)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_weights_and_kv_gpu_equal_cpu_fp32(tiny_model_dir, arch, enforce_eager):
    # fp32 activations: the Triton row-wise FP8 GEMM and the FP8-KV attention kernels against
    # the CPU path's exact scheme math; greedy tokens equal.
    path = tiny_model_dir(arch)
    common = dict(dtype="float32", max_model_len=256, num_kv_blocks=512, max_num_seqs=16,
                  quantization="fp8", kv_cache_dtype="fp8", calibrate_kv_scales=4)  # fmt: skip
    batch = prompts(20)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    cpu = LLM(path, device="cpu", **common).generate(batch, params, use_tqdm=False)
    gpu_llm = LLM(path, device="cuda", enforce_eager=enforce_eager, **common)
    gpu = gpu_llm.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    model = gpu_llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert not model.norms_folded  # an FP8 weight cannot take the norm's weight


def test_fp8_bf16_gpu_scores_close_to_cpu_reference(tiny_model_dir):
    # bf16 activations: torch._scaled_mm with row-wise scales; the CPU reference in fp32.
    path = tiny_model_dir("llama")
    batch = prompts(8, seed=1)
    cands = [[[5 + i % 400 for i in range(j, j + 24)]] for j in range(len(batch))]
    opts = dict(max_model_len=256, num_kv_blocks=256, quantization="fp8", kv_cache_dtype="fp8")
    cpu = LLM(path, device="cpu", dtype="float32", **opts).score(batch, cands, use_tqdm=False)
    gpu = LLM(path, device="cuda", dtype="bfloat16", **opts).score(batch, cands, use_tqdm=False)
    gaps = [abs(a[0].mean - b[0].mean) for a, b in zip(cpu, gpu)]
    assert max(gaps) < 0.05, gaps  # mean log-prob per token, bf16 rounding only


@pytest.mark.skipif(not TRAINED.is_dir(), reason="examples/trained-tiny is not in this checkout")
def test_trained_tiny_perplexity_fp8_within_one_percent(tmp_path):
    from batchgen.models.stdlib_text import joined_text, read_split

    text = joined_text(read_split("eval"))[:60_000]
    common = dict(device="cuda", dtype="bfloat16", max_model_len=512)
    results = {}
    for name, opts in {
        "bf16": {},
        "fp8-weights": {"quantization": "fp8"},
        "fp8-kv": {"kv_cache_dtype": "fp8", "calibrate_kv_scales": 16},
        "both": {"quantization": "fp8", "kv_cache_dtype": "fp8", "calibrate_kv_scales": 16},
    }.items():
        llm = LLM(str(TRAINED), **common, **opts)
        (out,) = llm.perplexity([text], context=512, stride=256, use_tqdm=False)
        results[name] = out.perplexity
    for name in ("fp8-weights", "fp8-kv", "both"):
        assert results[name] <= results["bf16"] * 1.01, results


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_only_checkpoint_runs_in_the_activations_dtype(tiny_model_dir, tmp_path, dtype):
    # Weight-only FP8 runs on the GPU as 16-bit GEMMs of the dequantized weights, which must
    # take the activations' dtype (fp16 activations against bf16 weights cannot multiply).
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from fp8_checkpoints import write_compressed_tensors

    ckpt = write_compressed_tensors(tiny_model_dir("llama"), tmp_path / "ct", "channel", None)
    batch = prompts(8, seed=2)
    cands = [[[5 + i % 400 for i in range(j, j + 24)]] for j in range(len(batch))]
    opts = dict(max_model_len=256, num_kv_blocks=256)
    cpu = LLM(ckpt, device="cpu", dtype="float32", **opts).score(batch, cands, use_tqdm=False)
    gpu_llm = LLM(ckpt, device="cuda", dtype=dtype, **opts)
    qkv = gpu_llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(qkv, Fp8Linear) and qkv.weight.dtype == getattr(torch, dtype)
    gpu = gpu_llm.score(batch, cands, use_tqdm=False)
    gaps = [abs(a[0].mean - b[0].mean) for a, b in zip(cpu, gpu)]
    assert max(gaps) < 0.05, gaps  # mean log-prob per token, 16-bit rounding only
