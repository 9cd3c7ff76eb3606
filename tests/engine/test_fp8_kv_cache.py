"""The engine with an FP8 KV cache equals transformers whose attention reads K/V rounded to e4m3
with the same per-layer scales; calibration, checkpoint scales, twice the tokens per byte."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.models.errors import ModelLoadError

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=96, num_kv_blocks=96, block_size=8)
SCALES = [(0.004, 0.006), (0.01, 0.003)]  # small: many values use e4m3's full range
PROMPTS = ["The committee measured the annual budget", "A small town approved"]
CANDIDATES = [" after a long debate on Monday.", " three new bridges by a wide margin."]


def _fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to e4m3 after dividing by scale, then multiplied back (written out here)."""
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _hf_with_fp8_kv(path: str, scales, observed: dict | None = None):
    """transformers' model whose attention sees K/V fake-quantized with `scales` (None: plain;
    observed: collects each layer's max |k|, |v| instead)."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if observed is not None:
            k, v = key.abs().max().item(), value.abs().max().item()
            old = observed.get(layer, (0.0, 0.0))
            observed[layer] = (max(old[0], k), max(old[1], v))
        if scales is not None:
            key, value = _fake_quant(key, scales[layer][0]), _fake_quant(value, scales[layer][1])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"batchgen_fp8_kv_test_{id(attention)}"  # looked up by name at each forward
    AttentionInterface.register(name, attention)
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=name
    ).eval()
    hf.attention_function = attention  # keeps the function (and its id) alive with the model
    return hf


def _hf_logprobs(hf, prompt_ids, cand_ids) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + cand_ids])).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(cand_ids)]


@pytest.fixture(scope="module")
def fp8_llm(tiny_model_dir):
    path = tiny_model_dir("qwen3")  # q/k-norm: K is quantized after the norm and rotary
    llm = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    llm.engine.set_kv_scales(SCALES)
    return path, llm


def test_scores_equal_transformers_with_fake_quantized_kv(fp8_llm):
    path, llm = fp8_llm
    hf_fp8, hf_plain = _hf_with_fp8_kv(path, SCALES), _hf_with_fp8_kv(path, None)
    results = llm.score(PROMPTS, [CANDIDATES] * 2, return_token_logprobs=True, use_tqdm=False)
    moved = 0.0
    for prompt, per_prompt in zip(PROMPTS, results):
        prompt_ids = llm.tokenizer.encode(prompt)
        for cand, res in zip(CANDIDATES, per_prompt):
            cand_ids = llm.tokenizer.encode(prompt + cand)[len(prompt_ids) :]
            ref = _hf_logprobs(hf_fp8, prompt_ids, cand_ids)
            plain = _hf_logprobs(hf_plain, prompt_ids, cand_ids)
            assert max(abs(a - b) for a, b in zip(res.token_logprobs, ref)) <= 2e-4
            moved = max(moved, max(abs(a - b) for a, b in zip(res.token_logprobs, plain)))
    assert moved > 1e-2  # the scales are small enough that FP8 changes the numbers


def test_greedy_decode_equals_transformers_with_fake_quantized_kv(fp8_llm):
    path, llm = fp8_llm
    hf = _hf_with_fp8_kv(path, SCALES)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()


def test_calibrated_scales_are_max_over_prompts(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    llm = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    scales = llm.calibrate_kv_scales(PROMPTS)
    observed: dict = {}
    hf = _hf_with_fp8_kv(path, None, observed)
    for prompt in PROMPTS:
        with torch.no_grad():
            hf(torch.tensor([llm.tokenizer.encode(prompt)]))
    for layer, (k, v) in enumerate(scales):
        assert k == pytest.approx(observed[layer][0] / 448, rel=1e-5)
        assert v == pytest.approx(observed[layer][1] / 448, rel=1e-5)
    with pytest.raises(ValueError, match="layer 1: K/V scales must be two finite numbers > 0"):
        llm.engine.set_kv_scales([(1.0, 1.0), (0.0, 1.0)])
    llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="on a fresh engine"):
        llm.calibrate_kv_scales(PROMPTS)


def test_option_calibrates_on_the_first_prompts_received(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = LLM(path, kv_cache_dtype="fp8", calibrate_kv_scales=2, **ENGINE)
    llm.generate(
        [*PROMPTS, "Every student questioned"], SamplingParams(max_tokens=2), use_tqdm=False
    )
    expected = LLM(path, kv_cache_dtype="fp8", **ENGINE).calibrate_kv_scales(PROMPTS)
    assert llm.engine.kv_scales() == expected


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_cache_holds_more_tokens_in_the_same_memory(tiny_model_dir, dtype, ratio):
    path = tiny_model_dir("llama")
    # 2 MiB: 64 float32 blocks of 16 tokens (2 layers x K/V x 2 heads x 32 x 4 bytes a token).
    opts = dict(dtype=dtype, max_model_len=64, cpu_kv_cache_gb=1 / 512, max_num_seqs=256)
    plain = LLM(path, **opts).engine.runner
    fp8 = LLM(path, kv_cache_dtype="fp8", **opts).engine.runner
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn and plain.kv_cache.dtype != fp8.kv_cache.dtype
    assert fp8.num_kv_blocks == ratio * plain.num_kv_blocks
    assert fp8.kv_cache.numel() == plain.kv_cache.numel() * plain.kv_cache.element_size() == 2**21


def _with_tensors(src: str, dst, extra: dict[str, torch.Tensor]) -> str:
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file({**tensors, **extra}, f"{dst}/model.safetensors")
    return str(dst)


def test_checkpoint_kv_scales_are_loaded(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    extra = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(2.0),  # older naming
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0),
    }
    path = _with_tensors(src, tmp_path / "m", extra)
    llm = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    assert llm.engine.kv_scales() == [(0.5, 0.25), (2.0, 4.0)]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, "lacks layer 0's v_scale"),
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, "per-head or per-channel"),
        ({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, "finite number > 0"),
    ],
)
def test_bad_checkpoint_kv_scales_are_refused(tiny_model_dir, tmp_path, extra, message):
    path = _with_tensors(tiny_model_dir("llama"), tmp_path / "m", extra)
    with pytest.raises(ModelLoadError, match=message):
        LLM(path, kv_cache_dtype="fp8", **ENGINE)
