"""Tensor-parallel engines in a process of their own, for tests/gpu/test_tensor_parallel_gpu.py:
ranks that wait on each other forever then cost that test its timeout (it prints their step
log), never the test session.

    python tests/gpu/tp_child.py SPEC.json OUT.json

SPEC: {"engines": [{"path", "options" (LLM keyword arguments), "mixed_graphs" (0 | 1: the
value of mixed_graph.TENSOR_PARALLEL_MIXED_GRAPHS while it starts)}, ...], "generate":
[[prompts, SamplingParams fields], ...], "score": [prompts, candidates] or absent}. The
engines run one after another in this process, each over the same work. OUT gets, per engine,
its token ids, scores, all-reduce choice and which graphs it captured.
"""

from __future__ import annotations

import json
import sys

from batchgen import LLM, SamplingParams
from batchgen.engine import mixed_graph


def run_engine(engine: dict, spec: dict) -> dict:
    mixed_graph.TENSOR_PARALLEL_MIXED_GRAPHS = int(engine.get("mixed_graphs", 0))
    with LLM(engine["path"], **engine["options"]) as llm:
        runner = llm.engine.runner
        result = {
            "one_shot": runner.one_shot,  # (threshold bytes, timings, why off) or None
            "graphs": runner.graphs is not None,
            "mixed_graphs": runner.mixed_graphs is not None,
            "mixed_chunk_tokens": runner.mixed_chunk_tokens,
            "generate": [],
        }
        for prompts, params in spec["generate"]:
            outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
            result["generate"].append([o.token_ids for o in outs])
        if spec.get("score"):
            prompts, candidates = spec["score"]
            rows = llm.score(prompts, candidates, use_tqdm=False)
            result["score"] = [[[c.score, c.num_tokens] for c in row] for row in rows]
    return result


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    results = []
    for engine in spec["engines"]:
        results.append(run_engine(engine, spec))
        print(f"tp_child: engine {len(results)} done", file=sys.stderr, flush=True)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump({"engines": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
