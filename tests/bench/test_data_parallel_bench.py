"""`batchgen bench --data-parallel-size 2` on CPU (two processes, the tiny preset): every
process runs its load and the report adds them up; one workload's requests split without
overlap or loss."""

from __future__ import annotations

import json

from click.testing import CliRunner

from batchgen.bench.cli import bench
from batchgen.bench.data_parallel import combine
from batchgen.bench.workloads import build_workload

SMOKE = ["--model-preset", "tiny", "--device", "cpu", "--max-output-tokens", "4",
         "--warmup", "1", "--workload", "nano", "--num-prompts", "3"]  # fmt: skip


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        bench, [*SMOKE, "--data-parallel-size", "2", *args, "--json", str(out)]
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "output tok/s (total)" in result.output
    return json.loads(out.read_text())


def test_full_load_runs_the_workload_on_each_process(tmp_path):
    report = _run(tmp_path)
    assert report["data_parallel_size"] == 2 and report["load"] == "full"
    assert report["devices"] == ["cpu", "cpu"]
    for worker in report["workers"]:
        assert worker["workload"]["num_requests"] == 3
        assert worker["result"]["errors"] == 0
        assert worker["result"]["output_tokens"] == worker["workload"]["output_tokens"] == 12
    r = report["result"]
    assert r["requests"] == 6 and r["output_tokens"] == 24
    slowest = max(w["result"]["wall_s"] for w in report["workers"])
    assert r["wall_s"] == slowest and r["output_tok_s"] == 24 / slowest


def test_split_load_deals_the_requests_out(tmp_path):
    report = _run(tmp_path, "--data-parallel-load", "split")
    assert [w["workload"]["num_requests"] for w in report["workers"]] == [2, 1]
    assert report["result"]["requests"] == 3 and report["result"]["output_tokens"] == 12


def test_workload_parts_cover_it_once():
    w = build_workload("shared-prefix", vocab_size=512, num_prompts=32, max_output_tokens=8)
    parts = [w.part(i, 3) for i in range(3)]
    assert sorted(p for part in parts for p in map(tuple, part.prompts)) == sorted(
        map(tuple, w.prompts)
    )
    assert sum(p.num_output_tokens for p in parts) == w.num_output_tokens
    # Each part's first request of a 16-prompt group shares nothing; the others its system.
    assert parts[0].shared_prefix_lens[:3] == [0, 2048, 2048]
    nano = build_workload("nano", vocab_size=512, num_prompts=5)
    assert nano.part(1, 2).shared_prefix_lens == [0, 0]


def test_combine_takes_the_slowest_wall_and_the_median_run():
    def report(walls: list[float], tokens: int) -> dict:
        runs = [{"output_tokens": tokens, "wall_s": t, "output_tok_s": tokens / t} for t in walls]
        return {"runs": runs, "result": runs[0], "workload": {"num_requests": 2, "name": "nano"},
                "model": {"name": "tiny"}, "device": "cpu", "repeat": len(walls)}  # fmt: skip

    got = combine([report([1.0, 2.0, 4.0], 10), report([2.0, 1.0, 1.0], 30)], [(), ()], "full")
    assert [r["wall_s"] for r in got["runs"]] == [2.0, 2.0, 4.0]
    assert got["result"]["output_tok_s"] == 20.0  # 40 tokens / 2 s, the median of 20, 20, 10
    assert got["result"]["per_gpu_output_tok_s"] == [10.0, 15.0]  # each one's own result
