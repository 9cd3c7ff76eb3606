"""Bench results: per-run metrics, the median, the environment record, the table, the JSON."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from batchgen.bench.timing import median_index
from batchgen.bench.workloads import Workload

# Keys every "result" block carries (None where they do not apply, e.g. GPU memory on CPU).
RESULT_FIELDS = (
    "wall_s",
    "output_tokens",
    "output_tok_s",
    "total_tok_s",
    "requests_s",
    "candidate_tok_s",
    "peak_gpu_memory_bytes",
    "prefix_cache_hit_rate",
    "shared_prefix_hit_rate",
    "preemptions",
    "steps",
    "errors",
    "roofline_output_tok_s",
    "roofline_fraction",
    "roofline_fraction_combined",
    "roofline_fraction_steps_taken",
    "experts_touched_per_layer_step",
    "ideal_decode_s",
    "ideal_prefill_s",
    "model_tflops",
    "achieved_tflops",
    "mfu",
    "mfu_vs_nominal_775",
    "step_roofline_fraction",
    "achieved_tb_s",
    "gpu",
)
TOP_FIELDS = (
    "date",
    "command",
    "git_commit",
    "source_tree",
    "device",
    "versions",
    "workload",
    "model",
    "engine_config",
    "ceilings",
    "repeat",
    "runs",
    "result",
    "prefix_caching_off",
    "pipeline",
    "peer",
)


def rates(run: dict[str, Any], w: Workload) -> dict[str, Any]:
    """Throughputs of one run. Total tokens = the workload's prompt (and candidate) tokens plus
    the generated ones; the engine's own prompt count repeats a score prompt per candidate."""
    wall = run["wall_s"]
    out = run.get("output_tokens", 0)
    total = w.num_prompt_tokens + w.num_candidate_tokens + out
    return {
        **run,
        "output_tok_s": out / wall,
        "total_tok_s": total / wall,
        "requests_s": w.num_requests / wall,
        "candidate_tok_s": w.num_candidate_tokens / wall if w.is_score else None,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (its numbers stay consistent with each other)."""
    return dict(runs[median_index([r["wall_s"] for r in runs])])


def hit_rates(run: dict[str, Any], w: Workload) -> dict[str, float | None]:
    prompt = run.get("prompt_tokens") or 0
    cached = run.get("cached_tokens") or 0
    return {
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
        # hits / tokens an ideal prefix cache would serve (shared-prefix: 15 of 16 per group)
        "shared_prefix_hit_rate": cached / w.num_shared_tokens if w.num_shared_tokens else None,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# The checkout batchgen runs from (git commands run there, not in the caller's directory).
SOURCE_DIR = Path(__file__).resolve().parents[2]


def _git_commit(cwd: Path = SOURCE_DIR) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            cwd=cwd,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _source_tree(cwd: Path = SOURCE_DIR) -> str:
    """Git's tree hash of the files in the working tree as they are (tracked, and untracked ones
    git does not ignore), staged into a throwaway index so the repository's own index is left
    alone. It equals `git rev-parse COMMIT^{tree}` when the files are COMMIT's, which checks a
    run made on a copied tree whose HEAD is stale (the GPU machine's copy)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
            for args in (["git", "add", "-A"], ["git", "write-tree"]):
                out = subprocess.run(
                    args, capture_output=True, text=True, timeout=60, check=True, env=env, cwd=cwd
                )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _command_line() -> str:
    """`batchgen bench ...` as typed (also under `python -m batchgen.cli`)."""
    argv = sys.argv or [""]
    if os.path.basename(argv[0]) in ("batchgen", "cli.py", "__main__.py"):
        return shlex.join(["batchgen", *argv[1:]])
    return shlex.join(argv)


def environment(device: torch.device) -> dict[str, Any]:
    """Date, command line, commit, device name and versions (transformers is not imported)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(),
        "git_commit": _git_commit(),
        "source_tree": _source_tree(),
        "device": name,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "batchgen": _version("batchgen"),
        },
    }


def write_json(path: str, report: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=False, default=str)
        f.write("\n")


def _fmt(value: Any, kind: str = "num") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "gib":
        return f"{value / 2**30:.2f}"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_table(report: dict[str, Any]) -> str:
    """One short table: ours, then the comparison column (peer, caching off, or pipeline)."""
    r = report["result"]
    cols: list[tuple[str, dict[str, Any]]] = [("batchgen", r)]
    ratios: list[tuple[str, float]] = []
    for key, label in (
        ("peer", "hf"),
        ("prefix_caching_off", "cache off"),
        ("pipeline", "pipeline"),
    ):
        block = report.get(key) or {}
        if block.get("result"):
            cols.append((label, block["result"]))
            if block.get("ratio") is not None:
                ratios.append((label, block["ratio"]))
    structured = report.get("structured")
    if structured:  # ours is the constrained run; the replay is the comparison
        cols.append(("replay", structured["replay"]["result"]))
        ratios.append(("replay", structured["ratio"]))
    rows = [
        ("output tok/s", "output_tok_s", "num"),
        ("total tok/s", "total_tok_s", "num"),
        ("candidate tok/s", "candidate_tok_s", "num"),
        ("requests/s", "requests_s", "num"),
        ("wall s", "wall_s", "num"),
        ("peak GPU GiB", "peak_gpu_memory_bytes", "gib"),
        ("roofline (decode)", "roofline_fraction", "pct"),
        ("roofline (dec+pre)", "roofline_fraction_combined", "pct"),
        ("roofline (steps)", "roofline_fraction_steps_taken", "pct"),
        ("experts/layer/step", "experts_touched_per_layer_step", "num"),
        ("MFU (measured mm)", "mfu", "pct"),
        ("MFU (775 TFLOP/s)", "mfu_vs_nominal_775", "pct"),
        ("roofline (per step)", "step_roofline_fraction", "pct"),
        ("step roofline tok/s", "step_roofline_output_tok_s", "num"),
        ("achieved TB/s", "achieved_tb_s", "num"),
        ("prefix hit rate", "prefix_cache_hit_rate", "pct"),
        ("shared-prefix hits", "shared_prefix_hit_rate", "pct"),
        ("preemptions", "preemptions", "num"),
        ("steps", "steps", "num"),
    ]
    w = report["workload"]
    head = (
        f"{w['name']} | {report['model']['name']} | {report['device']} | "
        f"median of {report['repeat']} | commit {report['git_commit'][:10]} "
        f"(tree {report.get('source_tree', 'unknown')[:10]})"
    )
    lines = [head, f"{'':20}" + "".join(f"{name:>14}" for name, _ in cols)]
    for label, key, kind in rows:
        values = [c.get(key) for _, c in cols]
        if all(v is None for v in values):
            continue
        lines.append(f"{label:20}" + "".join(f"{_fmt(v, kind):>14}" for v in values))
    for label, ratio in ratios:
        lines.append(f"{'batchgen / ' + label:20}{ratio:>13.2f}x")
    pipe = report.get("pipeline") or {}
    if pipe.get("overhead") is not None:
        lines.append(f"{'pipeline overhead':20}{_fmt(pipe['overhead'], 'pct'):>14}")
    for key in ("peer", "pipeline"):
        if (report.get(key) or {}).get("error"):
            lines.append(f"{key} unavailable: {report[key]['error']}")
    if structured:
        lines += structured_lines(structured, r)
    c = report["ceilings"]
    lines.append(
        f"ceilings: matmul {c['matmul_shape']} {c['matmul_dtype']} {c['matmul_tflops']:.1f} "
        f"TFLOP/s, copy {c['copy_tb_s']:.2f} TB/s"
    )
    gpu_line = format_gpu(r.get("gpu"))
    if gpu_line:
        lines.append(gpu_line)
    return "\n".join(lines)


def structured_lines(block: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """What a structured-output bench constrained, with what, and its host mask time."""
    reasons = ", ".join(f"{n} {k}" for k, n in sorted(block["finish_reasons"].items()))
    lines = [
        f"structured: {block['schema']} on every request ({reasons}); replay: the same "
        "output lengths unconstrained (ignore_eos)",
        f"tokenizer: {block['tokenizer']}",
    ]
    masks = result.get("masks")
    if masks:
        lines.append(
            f"token masks on the host: {masks['ms_per_step']:.2f} ms a step, "
            f"{masks['us_per_row']:.1f} us a row ({masks['steps']:,} steps, "
            f"{masks['seconds']:.2f} s in all)"
        )
    return lines


def format_gpu(gpu: dict[str, Any] | None) -> str | None:
    """One line on the GPU's clock and power during the median run (None off CUDA)."""
    if not gpu:
        return None
    if "error" in gpu:
        return f"GPU clock and power not sampled: {gpu['error']}"
    limit = gpu.get("power_limit_w")
    of_limit = f" of a {limit:.0f} W limit" if limit else ""
    return (
        f"GPU during the median run: SM {gpu['sm_mhz_median']:,.0f} MHz median "
        f"(p10 {gpu['sm_mhz_p10']:,.0f}), {gpu['power_w_mean']:.0f} W mean{of_limit}; "
        f"power cap in {100 * gpu['power_capped']:.0f}% of {gpu['samples']} samples"
    )
