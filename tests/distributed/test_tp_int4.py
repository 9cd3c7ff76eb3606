"""Tensor parallel with 4-bit checkpoints: each rank's 4-bit projections hold exactly its block of
the weights the format defines (cut from the test's own dequantization), act order on o / down
and blocks that are not whole groups are refused by name before any worker starts or weight
loads, and a two-rank engine generates what one rank does."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from batchgen.kernels.int4_gemm import dequantize_int4_ref
from int4_checkpoints import write_awq, write_compressed, write_gptq  # tests/models (conftest)
from safetensors.torch import load_file

from batchgen import LLM, SamplingParams
from batchgen.distributed.group import TensorParallel
from batchgen.distributed.workers import WorkerPool
from batchgen.job import JobError
from batchgen.job.load import validate_job
from batchgen.models.errors import ModelLoadError
from batchgen.models.loader import load_model
from batchgen.pipeline.engine_factory import model_limits

WRITERS = {
    "gptq-g128-asym": lambda p, t: write_gptq(p, t, 128, False, False, "gptq"),
    "gptq-channel": lambda p, t: write_gptq(p, t, -1, True, True, "gptq_v2"),
    "awq-g64": lambda p, t: write_awq(p, t, 64),
    "ct-g32-asym": lambda p, t: write_compressed(p, t, 32, False),
    "ct-g128-int8-zp": lambda p, t: write_compressed(p, t, 128, False, zp_packed=False),
}


def dense(layer) -> torch.Tensor:
    """An Int4Linear's weight [N, K] in input-channel order (reference dequantization)."""
    p = layer.packed()
    w = dequantize_int4_ref(p.qweight, p.scales, p.zeros, p.group_size)
    if p.perm is not None:
        out = torch.empty_like(w)
        out[p.perm] = w
        w = out
    return w.t()


def rank_block(ref: dict, cfg: dict, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Our projections -> this rank's rows / columns of the reference weights, by arithmetic."""
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] // size * d
    kv = cfg["num_key_value_heads"] // size * d
    inter = cfg["intermediate_size"] // size
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def w(name, p=p):
            return ref[p + name + ".weight"]

        out[p + "self_attn.qkv_proj"] = torch.cat([
            w("self_attn.q_proj")[rank * q : (rank + 1) * q],
            w("self_attn.k_proj")[rank * kv : (rank + 1) * kv],
            w("self_attn.v_proj")[rank * kv : (rank + 1) * kv],
        ])  # fmt: skip
        out[p + "self_attn.o_proj"] = w("self_attn.o_proj")[:, rank * q : (rank + 1) * q]
        out[p + "mlp.gate_up_proj"] = torch.cat([
            w("mlp.gate_proj")[rank * inter : (rank + 1) * inter],
            w("mlp.up_proj")[rank * inter : (rank + 1) * inter],
        ])  # fmt: skip
        out[p + "mlp.down_proj"] = w("mlp.down_proj")[:, rank * inter : (rank + 1) * inter]
    return out


@pytest.fixture(scope="module")
def tok_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.parametrize("variant", list(WRITERS))
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_holds_its_block_of_the_4_bit_weights(tmp_path, tok_dir, variant, rank):
    path = WRITERS[variant](str(tmp_path), tok_dir)
    tp = TensorParallel(rank, 2, torch.device("cpu"))  # no process group: loading needs none
    model, _ = load_model(path, "float32", "cpu", tp=tp)
    cfg = json.load(open(os.path.join(path, "config.json")))
    ref = load_file(os.path.join(path, "reference", "model.safetensors"))
    for name, want in rank_block(ref, cfg, rank, 2).items():
        got = dense(model.get_submodule(name))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_act_order_is_not_split(tmp_path, tok_dir):
    path = write_gptq(str(tmp_path), tok_dir, 64, True, False, "gptq")
    tp = TensorParallel(0, 2, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=2: .*_proj\.g_idx is in act "
                       r"order .* run this checkpoint with tensor_parallel_size 1"):  # fmt: skip
        load_model(path, "float32", "cpu", tp=tp)
    # Column-parallel projections keep every input: act order there splits (rows of N).
    path = write_gptq(
        str(tmp_path / "qkv"),
        tok_dir,
        64,
        True,
        False,
        "gptq",
        quantize=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    )
    model, _ = load_model(path, "float32", "cpu", tp=tp)
    assert model.model.layers[0].self_attn.qkv_proj.packed().perm is not None


def test_refused_before_any_worker_starts_or_weight_loads(tmp_path, tok_dir, monkeypatch):
    path = write_gptq(str(tmp_path), tok_dir, 32, True, True, "gptq")

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(WorkerPool, "start", no_workers)
    with pytest.raises(ModelLoadError, match=r"(o|down)_proj\.g_idx is in act order"):
        LLM(path, tensor_parallel_size=2, dtype="float32", num_kv_blocks=64)
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": 1, "text": "a"}\n')
    job = validate_job({
        "model": {"path": path, "tensor_parallel_size": 2},
        "input": {"path": str(data)},
        "prompt": {"template": "{text}"},
        "output": {"path": str(tmp_path / "out")},
    })  # fmt: skip
    with pytest.raises(JobError, match=r"model\.path: .*tensor_parallel_size=2: .*act order"):
        model_limits(job)
    model_limits(replace(job, model=replace(job.model, options=())))  # one rank: fine


def test_blocks_must_fall_on_whole_groups(tmp_path, tok_dir):
    # With group 256, 4 ranks' blocks of down_proj's 512 inputs (128 each) are not whole groups.
    path = write_gptq(str(tmp_path), tok_dir, 256, False, True, "gptq")
    tp = TensorParallel(0, 4, torch.device("cpu"))
    with pytest.raises(
        ModelLoadError,
        match=r"tensor_parallel_size=4 cannot split model\.layers\.0\.mlp\.down_proj: a rank's "
        r"128 inputs \(from 0\) do not fall on whole groups of 256",
    ):
        load_model(path, "float32", "cpu", tp=tp)


def test_two_ranks_generate_what_one_does(tmp_path, tok_dir):
    path = write_gptq(str(tmp_path), tok_dir, 32, False, False, "gptq")
    options = dict(dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=8,
                   max_num_batched_tokens=16)  # fmt: skip
    prompts = [[1, 5, 9, 33, 2, 7, 81, 40], [3, 4, 100, 200, 17, 9], [17, 29]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = LLM(path, **options).generate(prompts, params, use_tqdm=False)
    parallel = LLM(path, tensor_parallel_size=2, **options)
    try:
        got = parallel.generate(prompts, params, use_tqdm=False)
    finally:
        parallel.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len({tuple(o.token_ids) for o in want}) > 1
