"""`batchgen bench --tensor-parallel-size 2` on CPU: every rank builds its share of the random
preset, the run completes, and the report says what ran (per-rank roofline)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from batchgen.bench.cli import bench
from batchgen.models.presets import BENCH_PRESETS


def test_tensor_parallel_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--model-preset", "tiny", "--device", "cpu", "--max-output-tokens", "4",
            "--warmup", "1", "--workload", "nano", "--num-prompts", "3",
            "--tensor-parallel-size", "2", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert report["engine_config"]["tensor_parallel_size"] == 2
    assert report["model"]["tensor_parallel_size"] == 2
    assert report["result"]["errors"] == 0
    assert report["result"]["output_tokens"] == report["workload"]["output_tokens"] > 0
    # Rank 0's share: half the heads' KV bytes per token of the whole model's.
    c = {"layers": 2, "kv_heads": 2, "head_dim": 16}  # the tiny preset
    whole = 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * 4  # fp32
    assert report["model"]["kv_bytes_per_token"] == whole // 2
    assert report["model"]["all_reduce"]["why_nccl"] == "not a bf16/fp32 GPU"


def test_tensor_parallel_structured_bench(tmp_path):
    """--structured-schema with two ranks: rank 0's engine masks, the replay matches its length."""
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
                "required": ["ok", "n"],
                "additionalProperties": False,
            }
        )
    )
    out = tmp_path / "bench.json"
    args = ["--model-preset", "tiny", "--device", "cpu", "--warmup", "1", "--num-prompts", "3",
            "--tensor-parallel-size", "2", "--structured-schema", str(schema),
            "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert report["model"]["tensor_parallel_size"] == 2
    block = report["structured"]
    assert block["finish_reasons"] == {"stop": 3}  # every request ended with its JSON
    assert report["result"]["errors"] == 0 and report["result"]["masks"]["rows"] > 0
    assert block["replay"]["result"]["output_tokens"] == block["output_tokens"] > 0


def test_tensor_parallel_moe_bench_reports_rank_zeros_experts(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--model-preset", "tiny-moe", "--device", "cpu", "--max-output-tokens", "4",
            "--warmup", "1", "--workload", "nano", "--num-prompts", "3",
            "--tensor-parallel-size", "2", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert report["model"]["tensor_parallel_size"] == 2
    assert report["result"]["errors"] == 0
    assert report["result"]["output_tokens"] == report["workload"]["output_tokens"] > 0
    # Rank 0 holds half of each expert: gate, up and down of moe_intermediate_size 32 / 2 rows
    # at hidden 64 (the tiny-moe preset), in fp32.
    experts = report["model"]["experts"]
    assert experts["expert_params"] == 3 * 16 * 64
    assert experts["expert_bytes"] == experts["expert_params"] * 4
    assert 2 <= report["result"]["experts_touched_per_layer_step"] <= 8
    assert report["result"]["roofline_fraction_steps_taken"] > 0


def test_llama_70b_preset_shape():
    c = BENCH_PRESETS["llama3.1-70b"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (8192, 28672, 80)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (64, 8, 128256)
    assert c["rope_scaling"]["rope_type"] == "llama3"
