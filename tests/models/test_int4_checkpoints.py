"""4-bit checkpoints in GPTQ, AWQ and compressed-tensors layouts (written by int4_checkpoints.py,
independently of batchgen's code) load into batchgen with the logits of transformers run on the
weights the format defines, dequantized by the test and saved as an ordinary checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from int4_checkpoints import write_awq, write_compressed, write_gptq
from safetensors.torch import load_file

from batchgen import LLM, SamplingParams
from batchgen.layers.context import AttentionContext
from batchgen.layers.int4_linear import Int4Linear
from batchgen.models.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 33, 2, 7, 81, 40], [3, 4, 100, 200], [17]]


def ragged_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionContext.for_prompts([len(p) for p in prompts]))
        return model.compute_logits(hidden)  # [T, V]


def reference_logits(path: str) -> torch.Tensor:
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])


def assert_matches_reference(path: str) -> torch.nn.Module:
    model, _ = load_model(path, "float32", "cpu")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 8  # 2 layers x 4
    ours = ragged_logits(model, PROMPTS)
    ref = reference_logits(os.path.join(path, "reference"))
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    return model


@pytest.fixture(scope="module")
def tok_dir(tiny_model_dir):
    return tiny_model_dir("llama")  # its tokenizer files go into every checkpoint


GPTQ_CASES = [
    # (group, desc_act, sym, checkpoint_format)
    (32, False, True, "gptq"),
    (32, True, False, "gptq"),
    (128, False, False, "gptq_v2"),
    (128, True, True, "gptq"),
    (-1, False, False, "gptq"),
    (-1, True, True, "gptq_v2"),
    (64, True, False, "gptq_v2"),
]


@pytest.mark.parametrize("group, desc_act, sym, fmt", GPTQ_CASES)
def test_gptq_logits_equal_reference(tmp_path, tok_dir, group, desc_act, sym, fmt):
    model = assert_matches_reference(write_gptq(str(tmp_path), tok_dir, group, desc_act, sym, fmt))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert (qkv.perm is not None) == (desc_act and group != -1)  # act order sorted at load


@pytest.mark.parametrize("group", [32, 128])
def test_awq_logits_equal_reference(tmp_path, tok_dir, group):
    assert_matches_reference(write_awq(str(tmp_path), tok_dir, group))


CT_CASES = [
    # (group, sym, zero points packed, actorder)
    (128, True, True, None),
    (32, False, True, None),
    (-1, True, True, None),
    (64, False, False, "weight"),
    (128, True, True, "group"),
]


@pytest.mark.parametrize("group, sym, zp_packed, actorder", CT_CASES)
def test_compressed_tensors_logits_equal_reference(
    tmp_path, tok_dir, group, sym, zp_packed, actorder
):
    path = write_compressed(str(tmp_path), tok_dir, group, sym, zp_packed=zp_packed,
                            actorder=actorder)  # fmt: skip
    assert_matches_reference(path)


@pytest.mark.parametrize("group, sym", [(32, False), (-1, True), (128, True)])
def test_compressed_tensors_library_agrees_with_the_test_packing(tmp_path, tok_dir, group, sym):
    # The format's own library decompresses the test's tensors to the test's reference weights
    # (in the scales' float16, its output dtype): the writer follows the published layout.
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    path = write_compressed(str(tmp_path), tok_dir, group, sym)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    reference = load_file(os.path.join(path, "reference", "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        weights = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]
    args = ct.quantization.QuantizationArgs(**{k: v for k, v in weights.items() if v is not None})
    scheme = ct.quantization.QuantizationScheme(targets=["Linear"], weights=args)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        module = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(name + ".")}
        out = PackedQuantizationCompressor.decompress(module, scheme)["weight"]
        want = reference[name + ".weight"]
        torch.testing.assert_close(out.float(), want.half().float(), rtol=2e-3, atol=1e-4)


def test_gptq_v1_zero_points_are_stored_minus_one(tmp_path, tok_dir):
    # The same tensors read as gptq_v2 give other logits: the +1 of the v1 convention matters,
    # so the equality above is not an accident of symmetric zero points.
    path = write_gptq(str(tmp_path), tok_dir, 32, False, False, "gptq")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    with open(config_path, "w") as f:
        json.dump(config, f)
    model, _ = load_model(path, "float32", "cpu")
    ref = reference_logits(os.path.join(path, "reference"))
    assert (ragged_logits(model, PROMPTS) - ref).abs().max().item() > 1e-2


def test_gptq_quantized_lm_head(tmp_path, tok_dir):
    # lm_head: true: the checkpoint stores the LM head in 4 bits too (the embedding stays).
    path = write_gptq(str(tmp_path), tok_dir, 128, False, True, "gptq", lm_head=True)
    model, _ = load_model(path, "float32", "cpu")
    assert isinstance(model.lm_head, Int4Linear)
    ref = reference_logits(os.path.join(path, "reference"))
    assert (ragged_logits(model, PROMPTS) - ref).abs().max().item() <= 1e-4


def test_llm_generates_from_a_gptq_checkpoint(tmp_path, tok_dir):
    # The engine end to end: greedy tokens equal transformers' greedy decode of the reference.
    path = write_gptq(str(tmp_path), tok_dir, 64, True, False, "gptq")
    llm = LLM(path, dtype="float32", device="cpu")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(path, "reference"), dtype=torch.float32
    ).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[
            0, ids.shape[1] :
        ]
    assert out.token_ids == want.tolist()
