"""`batchgen bench` smoke runs on CPU with the tiny preset (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from batchgen.bench.cli import bench
from batchgen.bench.report import RESULT_FIELDS, TOP_FIELDS

SMOKE = ["--model-preset", "tiny", "--device", "cpu", "--max-output-tokens", "4", "--warmup", "1"]


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, [*SMOKE, *args, "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert "output tok/s" in result.output
    assert result.output.rstrip().splitlines()[-1].startswith("ceilings:")  # the table is last
    return report


def _assert_result(block: dict) -> None:
    missing = [k for k in RESULT_FIELDS if k not in block]
    assert not missing, missing


def test_nano_smoke_json_has_every_field(tmp_path):
    report = _run(tmp_path, "--workload", "nano", "--num-prompts", "4", "--repeat", "2")
    assert [k for k in TOP_FIELDS if k not in report] == []
    _assert_result(report["result"])
    assert len(report["runs"]) == 2
    assert report["workload"]["num_requests"] == 4
    assert report["result"]["output_tokens"] == report["workload"]["output_tokens"]
    assert report["result"]["errors"] == 0
    for key in ("torch", "triton", "transformers"):
        assert key in report["versions"]
    assert report["git_commit"] and report["device"].startswith("cpu")
    assert report["ceilings"]["matmul_tflops"] > 0 and report["ceilings"]["copy_tb_s"] > 0
    assert report["result"]["roofline_fraction"] > 0 and report["result"]["mfu"] > 0
    assert report["peer"] is None


def test_fp8_kv_cache_smoke_counts_fp8_bytes(tmp_path):
    args = ("--workload", "nano", "--num-prompts", "2")
    plain = _run(tmp_path, *args)
    fp8 = _run(tmp_path, *args, "--kv-cache-dtype", "fp8", "--calibrate-kv-scales", "1")
    assert fp8["model"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert fp8["engine_config"]["kv_cache_dtype"] == "fp8"
    # CPU runs float32: an FP8 cache is a quarter of its bytes per token, and four times the
    # blocks fit the same cpu_kv_cache_gb.
    assert fp8["model"]["kv_bytes_per_token"] * 4 == plain["model"]["kv_bytes_per_token"]
    assert fp8["result"]["decode_gbytes"] < plain["result"]["decode_gbytes"]
    assert fp8["result"]["output_tokens"] == plain["result"]["output_tokens"]


def test_fp8_weights_smoke(tmp_path):
    args = ("--workload", "nano", "--num-prompts", "2")
    plain = _run(tmp_path, *args)
    fp8 = _run(tmp_path, *args, "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert fp8["engine_config"]["quantization"] == "fp8"
    # The projections' weights are 1 byte instead of 4 (CPU float32), plus a scale per row.
    assert fp8["model"]["weight_bytes"] < plain["model"]["weight_bytes"] * 0.6
    assert fp8["result"]["output_tokens"] == plain["result"]["output_tokens"]
    result = CliRunner().invoke(bench, [*SMOKE, "--quantization", "fp8", "--peer", "hf"])
    assert result.exit_code == 2 and "without --quantization" in result.output


def test_moe_smoke_reports_the_experts_roofline(tmp_path):
    report = _run(
        tmp_path, "--workload", "nano", "--num-prompts", "4", "--model-preset", "tiny-moe"
    )
    result = report["result"]
    _assert_result(result)
    assert report["model"]["architecture"] == "Qwen3MoeForCausalLM"
    assert report["model"]["experts"]["num_experts"] == 8
    # Each step's tokens reach between top_k (2) and all 8 experts of the sparse layer.
    assert 2 <= result["experts_touched_per_layer_step"] <= 8
    assert result["experts_touched"] >= 2 * result["steps"]
    assert result["roofline_fraction_steps_taken"] > 0 and result["roofline_fraction"] > 0


def test_shared_prefix_smoke_runs_caching_off(tmp_path):
    report = _run(tmp_path, "--workload", "shared-prefix", "--num-prompts", "16")
    off = report["prefix_caching_off"]
    _assert_result(off["result"])
    assert off["result"]["cached_tokens"] == 0 and off["ratio"] > 0
    assert report["result"]["shared_prefix_hit_rate"] > 0


def test_score_smoke(tmp_path):
    report = _run(tmp_path, "--workload", "score", "--num-prompts", "2")
    result = report["result"]
    assert result["candidate_tok_s"] > 0 and result["mfu"] > 0
    assert result["candidate_tokens"] == report["workload"]["candidate_tokens"]


def test_pipeline_smoke(tmp_path):
    report = _run(tmp_path, "--workload", "pipeline", "--num-prompts", "6")
    pipe = report["pipeline"]
    assert pipe["result"]["rows_ok"] == 6 and pipe["result"]["exit_code"] == 0
    assert pipe["overhead"] is not None


def test_peer_hf_smoke(tmp_path):
    pytest.importorskip("transformers")
    report = _run(tmp_path, "--workload", "nano", "--num-prompts", "2", "--peer", "hf")
    peer = report["peer"]
    assert peer.get("error") is None, peer.get("error")
    _assert_result(peer["result"])
    assert peer["result"]["output_tokens"] == report["result"]["output_tokens"]
    assert peer["ratio"] > 0


def test_transformers_is_not_imported_without_peer(tmp_path):
    code = (
        "import sys; from click.testing import CliRunner; from batchgen.bench.cli import bench; "
        f"r = CliRunner().invoke(bench, {SMOKE + ['--num-prompts', '1']!r}); "
        "assert r.exit_code == 0, r.output; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def test_model_hub_id_is_resolved_before_anything_runs(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    result = CliRunner().invoke(bench, [*SMOKE, "--model", "no-org/no-model"])
    assert result.exit_code == 2
    assert "not a local directory, nor in the hub cache" in result.output
    assert "hf download no-org/no-model" in result.output
    result = CliRunner().invoke(bench, [*SMOKE, "--revision", "main"])
    assert result.exit_code == 2 and "needs --model" in result.output


def test_gptq_single_stream_smoke(tmp_path):
    # Random 4-bit GPTQ projections (one group per channel: the tiny preset's 64 / 176 inputs),
    # one stream; the report carries the per-step roofline and the bandwidth drawn.
    report = _run(tmp_path, "--workload", "single-stream", "--quantization", "gptq",
                  "--int4-group-size", "-1", "--int4-act-order")  # fmt: skip
    result = report["result"]
    _assert_result(result)
    assert report["model"]["quantization"] == "gptq"
    assert report["workload"]["num_requests"] == 1
    assert result["step_roofline_fraction"] > 0 and result["achieved_tb_s"] > 0
    assert result["step_roofline_kv_tokens"] > 0
    # The 4-bit model counts its projections' in x out weights as parameters (MFU) and their
    # packed bytes as weights (roofline): ~1/4 of the fp32 bytes of the same projections.
    assert report["model"]["non_embedding_parameters"] > 0


def test_gptq_refused_with_a_checkpoint_or_the_peer(tmp_path):
    result = CliRunner().invoke(bench, [*SMOKE, "--quantization", "gptq", "--peer", "hf"])
    assert result.exit_code != 0 and "without --quantization" in result.output
    result = CliRunner().invoke(bench, [*SMOKE, "--int4-group-size", "48"])
    assert result.exit_code != 0 and "multiple of 32" in result.output
    result = CliRunner().invoke(bench, [*SMOKE, "--quantization", "gptq", "--int4-act-order",
                                        "--tensor-parallel-size", "2"])  # fmt: skip
    assert result.exit_code == 2 and "act order cannot be split" in result.output
    moe = [a if a != "tiny" else "tiny-moe" for a in SMOKE]
    result = CliRunner().invoke(bench, [*moe, "--quantization", "gptq"])
    assert result.exit_code == 2 and "tiny-moe is a mixture-of-experts model" in result.output


def test_structured_smoke_runs_the_replay(tmp_path):
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
    args = ["--model-preset", "tiny", "--device", "cpu", "--warmup", "1", "--num-prompts", "4"]
    result = CliRunner().invoke(
        bench, [*args, "--structured-schema", str(schema), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    block = report["structured"]
    assert block["finish_reasons"] == {"stop": 4}  # every request ended with its JSON
    assert block["tokenizer"].startswith("wide BPE, 512 tokens")
    replay = block["replay"]["result"]
    # The replay generated exactly the constrained run's tokens, unconstrained.
    assert replay["output_tokens"] == report["result"]["output_tokens"] == block["output_tokens"]
    assert sum(block["replay"]["max_tokens"]) == block["output_tokens"]
    assert block["ratio"] > 0 and report["result"]["masks"]["rows"] > 0
    assert replay["masks"] is None
    assert "batchgen / replay" in result.output and "token masks on the host" in result.output
