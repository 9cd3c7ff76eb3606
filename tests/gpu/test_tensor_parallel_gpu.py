"""On two GPUs: tensor parallel 2 (NCCL, CUDA graphs capturing the all-reduces, the one-shot
all-reduce where it wins) equals tensor parallel 1 in fp32, with mixed steps run eagerly (the
default) and with mixed-step graphs; a second engine in the same process starts (on NCCL) and
agrees too; bf16 reports where outputs first diverge; the one-shot kernel equals NCCL; a killed
worker fails the run with its rank.

Every tensor-parallel engine but the killed worker's runs in a child process (tp_child.py) with
BATCHGEN_TP_TRACE=1 and a timeout: ranks that wait on each other fail their test with the tail
of the ranks' log (phases, capture plans, one line per step) instead of stalling the session.
The references (tensor parallel 1) run in this process.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.distributed.group import TensorParallelError
from batchgen.models.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

COMMON = dict(max_model_len=512, num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256)
CHILD = Path(__file__).with_name("tp_child.py")
# One child: start-up (a bare machine compiles kernels), then a few generations of tiny models.
CHILD_TIMEOUT_S = 300
GREEDY = dict(max_tokens=48, temperature=0.0)
SAMPLED = dict(max_tokens=16, temperature=0.8, seed=3)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 300))] for _ in range(n)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tail(log: str, lines: int = 120) -> str:
    return "\n".join(log.splitlines()[-lines:])


def step_kinds(log: str) -> dict[str, int]:
    """Rank 0's steps by kind ("decode-graph", "mixed-graph", "eager") in a step log."""
    kinds: dict[str, int] = {}
    for kind in re.findall(r"^\[tp rank 0\] step \d+: (\S+)", log, flags=re.M):
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def run_tp(tmp_path: Path, engines: list[dict], spec: dict) -> tuple[list[dict], str]:
    """Run `engines` one after another in a child process over `spec`'s work (tp_child.py).
    Returns (each engine's results, the ranks' log); a hang or an error fails the test with the
    log's tail."""
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps({**spec, "engines": engines}))
    env = {**os.environ, "BATCHGEN_TP_TRACE": "1"}
    command = [sys.executable, str(CHILD), str(spec_path), str(out_path)]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired as e:  # the child is killed; its workers follow it
        log = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(
            f"tensor parallel still running after {CHILD_TIMEOUT_S} s (ranks waiting on each "
            f"other?); the ranks' log ends:\n{tail(log or '')}"
        )
    if proc.returncode != 0:
        pytest.fail(f"tensor parallel run failed (exit {proc.returncode}):\n{tail(proc.stderr)}")
    print(f"rank 0 steps by kind: {step_kinds(proc.stderr)}")
    return json.loads(out_path.read_text())["engines"], proc.stderr


def reference(path: str, spec: dict, **options) -> dict:
    """Tensor parallel 1 in this process, over the same work as tp_child.py."""
    llm = LLM(path, **options)
    out = {"generate": []}
    for batch, params in spec["generate"]:
        outs = llm.generate(batch, SamplingParams(**params), use_tqdm=False)
        out["generate"].append([o.token_ids for o in outs])
    if spec.get("score"):
        rows = llm.score(*spec["score"], use_tqdm=False)
        out["score"] = [[[c.score, c.num_tokens] for c in row] for row in rows]
    del llm
    torch.cuda.empty_cache()  # the child's rank 0 shares cuda:0
    return out


def fp32_spec() -> dict:
    batch = prompts(24)
    cands = [[p[1:9], [7, 8, 9]] for p in batch[:6]]
    return {
        "generate": [[batch, GREEDY], [batch[:6], SAMPLED]],
        "score": [[p[:40] for p in batch[:6]], cands],
    }


def assert_same(got: dict, want: dict) -> None:
    assert got["generate"] == want["generate"]
    for g_row, w_row in zip(got.get("score", []), want.get("score", [])):
        for (g, g_n), (w, w_n) in zip(g_row, w_row):
            assert g_n == w_n and abs(g - w) <= 1e-4


@pytest.mark.parametrize(
    "arch, options, mixed_graphs",
    [
        ("llama", {}, 0),  # folded norms, decode graphs, one-shot all-reduce
        ("qwen3", {"mixed_chunk_tokens": 48}, 0),  # q/k-norm, tied; mixed steps eager
        ("qwen3", {"mixed_chunk_tokens": 48}, 1),  # mixed-step graphs (chunk on a side stream)
        ("qwen2", {"enforce_eager": True}, 0),  # biases, eager
    ],
)
def test_tp2_greedy_equals_tp1_fp32(tiny_model_dir, tmp_path, arch, options, mixed_graphs):
    path = tiny_model_dir(arch)
    spec = fp32_spec()
    ref_options = dict(options)
    if options.get("mixed_chunk_tokens") and not mixed_graphs:
        # Eager mixed steps carry no prompt tokens in graph padding rows: the same batches
        # as one GPU without graphs.
        ref_options["enforce_eager"] = True
    want = reference(path, spec, dtype="float32", **COMMON, **ref_options)
    engine = {
        "path": path,
        "options": dict(dtype="float32", tensor_parallel_size=2, **COMMON, **options),
        "mixed_graphs": mixed_graphs,
    }
    (got,), log = run_tp(tmp_path, [engine], spec)
    print(f"{arch}: one-shot all-reduce {got['one_shot']}")
    assert got["graphs"] == (not options.get("enforce_eager"))  # all-reduces inside graphs
    if options.get("mixed_chunk_tokens"):
        assert got["mixed_chunk_tokens"] == 48
        assert got["mixed_graphs"] == bool(mixed_graphs)
        kind = "mixed-graph" if mixed_graphs else "eager"
        assert re.search(rf"\[tp rank 1\] step \d+: {kind} .*decode=[1-9]\d* chunks=[1-9]", log)
    assert_same(got, want)


def test_tp2_structured_equals_tp1_fp32(tiny_model_dir, tmp_path):
    """Structured output under tensor parallel: rank 0 masks the gathered logits (decode graphs,
    masks on a side stream, async scheduling), the same tokens as one GPU, every one valid."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "b"]}},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    constrained = dict(max_tokens=96, structured_outputs={"json": schema})
    batch = prompts(16, seed=4)
    spec = {
        "generate": [
            [batch, dict(temperature=0.0, **constrained)],
            [batch, dict(temperature=0.9, top_p=0.9, seed=7, **constrained)],
        ]
    }
    path = tiny_model_dir("qwen3")
    want = reference(path, spec, dtype="float32", **COMMON)
    engine = {"path": path, "options": dict(dtype="float32", tensor_parallel_size=2, **COMMON)}
    (got,), _ = run_tp(tmp_path, [engine], spec)
    assert got["generate"] == want["generate"]
    tokenizer = Tokenizer.from_dir(path)
    texts = [tokenizer.decode(ids) for run in got["generate"] for ids in run]
    valid = 0
    for text in texts:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue  # cut at max_tokens (a valid prefix: tests/engine/structured)
        jsonschema.validate(value, schema)
        valid += 1
    assert valid >= 0.8 * len(texts)


def test_second_engine_in_one_process(tiny_model_dir, tmp_path):
    """Two tensor-parallel engines one after another in one process: the second cannot
    rendezvous torch's symmetric memory again (its state is per process) and all-reduces
    through NCCL instead of waiting forever; both equal tensor parallel 1."""
    batch = prompts(8, seed=2)
    spec = {"generate": [[batch, dict(max_tokens=16, temperature=0.0)]]}
    llama, qwen3 = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    want = [
        reference(llama, spec, dtype="float32", **COMMON),
        reference(qwen3, spec, dtype="float32", **COMMON),
    ]
    options = dict(dtype="float32", tensor_parallel_size=2, **COMMON)
    engines = [{"path": llama, "options": options}, {"path": qwen3, "options": options}]
    got, _ = run_tp(tmp_path, engines, spec)
    assert "earlier tensor-parallel engine in this process" not in str(got[0]["one_shot"])
    limit, _, why = got[1]["one_shot"]
    assert limit == 0 and "earlier tensor-parallel engine in this process" in why
    assert [g["generate"] for g in got] == [w["generate"] for w in want]


def test_tp2_bf16_first_divergence(tiny_model_dir, tmp_path):
    """bf16 sums in another order across two ranks: outputs may part. Reported, and bounded:
    the prompts' log-likelihoods agree to bf16 rounding."""
    path = tiny_model_dir("llama")
    batch = prompts(32, seed=1)
    spec = {
        "generate": [[batch, dict(max_tokens=64, temperature=0.0, ignore_eos=True)]],
        "score": [[p[:24] for p in batch], [[p[1:17]] for p in batch]],
    }
    want = reference(path, spec, dtype="bfloat16", **COMMON)
    engine = {"path": path, "options": dict(dtype="bfloat16", tensor_parallel_size=2, **COMMON)}
    (got,), _ = run_tp(tmp_path, [engine], spec)
    pairs = list(zip(got["generate"][0], want["generate"][0]))
    positions = [first_divergence(g, w) for g, w in pairs]
    report = {
        "prompts": len(batch),
        "identical": sum(p is None for p in positions),
        "first_divergence": positions,
        "max_abs_score_diff_per_token": max(
            abs(g[0][0] - w[0][0]) / w[0][1] for g, w in zip(got["score"], want["score"])
        ),
    }
    print("bf16 tp2 vs tp1:", json.dumps(report))
    out = os.environ.get("BATCHGEN_REPORT_DIR")
    if out:
        with open(os.path.join(out, "tp_bf16_divergence.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    assert all(len(g) == 64 for g, _ in pairs)
    assert report["max_abs_score_diff_per_token"] <= 0.1


def test_one_shot_all_reduce_equals_nccl(tmp_path):
    """The measurement tool's check: the kernel's sums equal NCCL's eagerly and in graphs."""
    out = tmp_path / "ar.json"
    for dtype in ("bfloat16", "float32"):
        proc = subprocess.run(
            [sys.executable, "-m", "batchgen.bench.allreduce", "--world-size", "2",
             "--hidden", "4096", "--dtype", dtype, "--json", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        print(proc.stdout, proc.stderr[-2000:])
        report = json.loads(out.read_text())
        assert proc.returncode == 0, report.get("error")
        assert report["timings_us"] and all(t["nccl"] > 0 for t in report["timings_us"])


def test_killed_worker_fails_the_run(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="bfloat16", tensor_parallel_size=2, **COMMON)
    engine = llm.engine
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(8)):
        engine.add_request(str(i), p, params)
    for _ in range(5):
        engine.step()
    os.kill(engine.runner.peers.procs[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) died"):
        while time.monotonic() < deadline:
            engine.step()
    llm.shutdown()
