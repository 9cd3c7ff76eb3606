"""batchgen's round-to-nearest GPTQ writer: its checkpoint read back by the test's own unpacking
is the round-to-nearest weight (within half a step of the original), and batchgen runs it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from int4_checkpoints import base_config, dense_state, save
from safetensors.torch import load_file

from batchgen.layers.context import AttentionContext
from batchgen.models.int4.quantize import quantize_checkpoint
from batchgen.models.loader import load_model


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """[R/8, C] int32 -> [R, C], row 8i + j at bits 4j of word i (the GPTQ qweight layout)."""
    out = torch.empty(words.shape[0] * 8, words.shape[1], dtype=torch.int64)
    for j in range(8):
        out[j::8] = (words.long() >> (4 * j)) & 0xF
    return out


@pytest.fixture
def dense_dir(tmp_path, tiny_model_dir):
    tok = tiny_model_dir("llama")
    config = base_config(tok)
    state = dense_state(config, seed=3)
    path = str(tmp_path / "dense")
    save(path, config, state, state, tok)
    return path, state


PROMPT = [1, 5, 9, 33, 2, 7, 81, 40]


def logits(path: str) -> torch.Tensor:
    model, _ = load_model(path, "float32", "cpu")
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        hidden = model(ids, torch.arange(8), AttentionContext.for_prompts([8]))
        return model.compute_logits(hidden)


def read_back(tensors: dict, name: str, k: int, group: int) -> tuple:
    """(q [K, N], zeros [G, N], scales [G, N], group of each input channel) as GPTQ v1 defines
    them, unpacked by the test."""
    q = unpack_rows(tensors[name + ".qweight"])
    zeros = unpack_rows(tensors[name + ".qzeros"].t()).t() + 1  # v1 stores zero - 1
    g = torch.arange(k) // (k if group == -1 else group)
    return q, zeros, tensors[name + ".scales"].double(), g


@pytest.mark.parametrize("group, sym", [(128, True), (32, False), (-1, True)])
def test_round_to_nearest_gptq_checkpoint(tmp_path, dense_dir, group, sym):
    src, state = dense_dir
    dst = str(tmp_path / "q")
    quantize_checkpoint(src, dst, group, sym)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
    assert qc["group_size"] == group and qc["sym"] == sym
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    reference = {k: v for k, v in tensors.items() if not k.rpartition(".")[0].endswith("proj")}
    for name in sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".qweight")}):
        w = state[name + ".weight"].double()  # [N, K]
        n, k = w.shape
        q, zeros, scales, g = read_back(tensors, name, k, group)
        assert torch.equal(tensors[name + ".g_idx"].long(), g)
        deq = ((q - zeros[g]).double() * scales[g]).t()  # [N, K]
        reference[name + ".weight"] = deq.float()
        # Round to nearest: within half a step, except values clipped at the ends of the
        # 4-bit range (a group's largest magnitude when the float16 scale rounds down).
        err, step = (deq - w).abs(), scales[g].t()
        inside = (q.t() > 0) & (q.t() < 15)
        assert bool((err[inside] <= step[inside] / 2 + 1e-6).all())
        assert bool((err <= step + 1e-6).all())
        if sym:
            assert bool((zeros == 8).all())
            size = k if group == -1 else group
            want = (w.reshape(n, k // size, size).abs().amax(-1) / 7.5).t()
            torch.testing.assert_close(scales, want.half().double(), rtol=1e-3, atol=0)
    # batchgen runs the checkpoint as transformers runs the weights read back by the test.
    ref_dir = str(tmp_path / "reference")
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    save(ref_dir, plain, reference, reference, src)  # src has the tokenizer files
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    assert (logits(dst) - want).abs().max().item() <= 1e-4


def test_refuses_a_quantized_source(tmp_path, dense_dir):
    src, _ = dense_dir
    quantize_checkpoint(src, str(tmp_path / "q"), 128, True)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(str(tmp_path / "q"), str(tmp_path / "qq"))
