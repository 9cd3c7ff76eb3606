"""Each tensor-parallel rank loads exactly its slices of the checkpoint: q/k/v and gate/up rows
(fused in that order per rank), o/down columns, vocabulary rows; norms and o biases whole."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.distributed.group import TensorParallel
from batchgen.distributed.partition import RowBlock
from batchgen.models.errors import ModelLoadError
from batchgen.models.loader import load_model
from batchgen.models.make_model import make_model
from batchgen.models.weights import iter_tensors

VARIANTS = {
    "llama": ("llama", None),
    "qwen2-bias": ("qwen2", None),
    "qwen3-qknorm": ("qwen3", None),
    # One KV head for two ranks (replicated), o bias (row-parallel bias), tied embeddings.
    "llama-1kv": (
        "llama",
        {"num_key_value_heads": 1, "attention_bias": True, "tie_word_embeddings": True},
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    make_model(str(path), arch, seed=1, overrides=overrides)
    return str(path)


def expected_shard(hf: dict[str, torch.Tensor], cfg: dict, rank: int, size: int) -> dict:
    """Our parameter names -> rank's tensors, cut from the HF tensors by plain arithmetic."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    hq, hk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q_per, inter_per = hq // size * d, cfg["intermediate_size"] // size
    kv_head = rank * (hk // size) if hk >= size else rank * hk // size
    kv_per = max(1, hk // size) * d
    vocab_per = cfg["vocab_size"] // size

    def rows(t, start, n):
        return t[start : start + n]

    out = {}
    for name, t in hf.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            fused = name.replace("q_proj", "qkv_proj")
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            out[fused] = torch.cat(
                [rows(t, rank * q_per, q_per), rows(k, kv_head * d, kv_per),
                 rows(v, kv_head * d, kv_per)]
            )  # fmt: skip
        elif name.endswith("gate_proj.weight"):
            up = hf[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [rows(t, rank * inter_per, inter_per), rows(up, rank * inter_per, inter_per)]
            )
        elif name.endswith("o_proj.weight"):
            out[name] = t[:, rank * q_per : (rank + 1) * q_per]
        elif name.endswith("down_proj.weight"):
            out[name] = t[:, rank * inter_per : (rank + 1) * inter_per]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = rows(t, rank * vocab_per, vocab_per)
        elif not any(p in name for p in ("k_proj", "v_proj", "up_proj")):
            out[name] = t  # norms, o bias: whole on every rank
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_holds_its_slices(model_dir, rank):
    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    tp = TensorParallel(rank, 2, torch.device("cpu"))  # no process group: loading needs none
    model, _ = load_model(model_dir, "float32", "cpu", tp=tp)
    got = dict(model.named_parameters())
    want = expected_shard(hf, cfg, rank, 2)
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_slices_are_read_alone_and_checked_against_the_config(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    file = os.path.join(path, "model.safetensors")
    full = load_file(file)["model.layers.0.mlp.down_proj.weight"]  # [64, 176]
    block = RowBlock(88, 88, 176)
    select = {"model.layers.0.mlp.down_proj.weight": (1, block)}.get
    got = {n: t for _, n, t in iter_tensors([file], select)}
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], full[:, 88:])
    # A checkpoint whose tensor is not the size config.json gives is refused by name.
    broken = tmp_path / "m"
    shutil.copytree(path, broken)
    tensors = load_file(file)
    tensors["model.layers.0.mlp.down_proj.weight"] = full[:, :170].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"down_proj.weight.*expects 176 along dim 1"):
        list(iter_tensors([str(broken / "model.safetensors")], select))
