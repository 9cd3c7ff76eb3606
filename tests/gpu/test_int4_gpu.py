"""4-bit weights on the GPU: Int4Linear's tuned paths at Llama shapes against the reference, under
CUDA-graph capture, a 4-bit checkpoint end to end, and the bench's 4-bit presets."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from batchgen.kernels.int4_gemm import int4_gemm_ref

from batchgen.bench.random_int4 import random_gptq
from batchgen.layers import int4_tuning
from batchgen.layers.int4_linear import Int4Linear, dense_product
from batchgen.models.int4 import gptq

pytestmark = pytest.mark.gpu


def layer(n: int, k: int, group: int = 128, act_order: bool = False, sym: bool = True):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    tensors = random_gptq(n, k, group, act_order, gen, torch.device("cuda"))
    if not sym:  # zero points 0 .. 15 instead of 8 everywhere
        shape = tensors["qzeros"].shape
        tensors["qzeros"] = torch.randint(
            -(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=gen
        )
    out = Int4Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    out.set_packed(gptq.to_packed(tensors, group, True, "w"))
    return out


def ref(x: torch.Tensor, lin: Int4Linear) -> torch.Tensor:
    p = lin.packed()
    return int4_gemm_ref(x, p.qweight, p.scales, p.zeros, p.group_size, p.perm)


def assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (57344, 8192)])
@pytest.mark.parametrize("m", [1, 5, 64, 300, 2048])
def test_tuned_paths_equal_the_reference(n, k, m):
    lin = layer(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert_close_bf16(lin(x), ref(x, lin))
    assert int4_tuning._choices  # the row class was timed, and the winner ran


def test_choices_persist_for_the_next_process(tmp_path, monkeypatch):
    # The first product of a row class times the candidates and writes the winner to
    # int4_tuning.json; a later process (forget(): nothing in memory) reads it, timing nothing.
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    int4_tuning.forget()
    lin = layer(4096, 4096)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    want = lin(x)
    first = dict(int4_tuning._choices)
    assert len(first) == 1 and (tmp_path / "int4_tuning.json").exists()
    int4_tuning.forget()
    monkeypatch.setattr(int4_tuning, "fastest", lambda *a: pytest.fail("timed again"))
    assert torch.equal(lin(x), want)
    assert int4_tuning._choices == first
    int4_tuning.forget()


@pytest.mark.parametrize("act_order, sym, group", [(True, False, 128), (False, False, 32),
                                                   (True, True, -1)])  # fmt: skip
def test_act_order_and_zero_points_on_both_paths(act_order, sym, group):
    lin = layer(4096, 4096, group, act_order, sym)
    assert (lin.perm is not None) == (act_order and group != -1)
    assert (lin.zeros is None) == sym
    for m in (3, 4096):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        want = ref(x, lin)
        assert_close_bf16(lin(x), want)
        assert_close_bf16(dense_product(x, lin.packed()), want)


def test_cuda_graph_replays_the_tuned_kernel():
    lin = layer(28672, 4096)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    eager = lin(x)  # tunes the row class outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, lin(x), rtol=0, atol=0)
    assert not torch.equal(out, eager)


def test_gptq_checkpoint_on_cuda_equals_reference(tmp_path, tiny_model_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
    from int4_checkpoints import write_gptq
    from transformers import AutoModelForCausalLM

    from batchgen import LLM, SamplingParams
    from batchgen.layers.context import AttentionContext
    from batchgen.models.loader import load_model

    path = write_gptq(str(tmp_path), tiny_model_dir("llama"), 64, True, False, "gptq")
    model, _ = load_model(path, "float32", "cuda")
    prompt = [1, 5, 9, 33, 2, 7, 81, 40]
    ids = torch.tensor(prompt, device="cuda")
    with torch.no_grad():
        ctx = AttentionContext.for_prompts([len(prompt)], torch.device("cuda"))
        hidden = model(ids, torch.arange(len(prompt), device="cuda"), ctx)
        ours = model.compute_logits(hidden).cpu()
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(path, "reference"), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert (ours - want).abs().max().item() <= 1e-3
    llm = LLM(path, dtype="bfloat16", device="cuda")
    outs = llm.generate([prompt] * 3, SamplingParams(max_tokens=16, temperature=0.0))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


@pytest.mark.slow
def test_bench_single_stream_llama_8b_int4(tmp_path):
    import json

    from click.testing import CliRunner

    from batchgen.bench.cli import bench

    out = tmp_path / "r.json"
    args = ["--model-preset", "llama3.1-8b", "--quantization", "gptq", "--workload",
            "single-stream", "--max-output-tokens", "64", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["result"]["achieved_tb_s"] > 0.5 and report["result"]["errors"] == 0
