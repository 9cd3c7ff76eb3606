"""Time a workload (`nano` unless SWEEP_WORKLOAD=name[:num_prompts]) under several engine
settings: per setting, build the random-weight model and runner (the runner's CUDA graphs
depend on the settings), then run it ROUNDS times.

Usage (CUDA machine, repo root):
    [SWEEP_WORKLOAD=pipeline:2000] python examples/benchmarks/sweep_engine.py PRESET ROUNDS \
        SETTING [SETTING ...]
SETTING is `default` or comma-separated key=value engine options, e.g.
`max_num_batched_tokens=16384,max_num_seqs=128`; a key MODULE.NAME instead sets an int
constant of batchgen.engine.MODULE for that setting (e.g. `prompt_allowance.DUE_SLACK_STEPS=32`),
also where other modules imported it; a dotted MODULE names a module under batchgen
(`layers.attention.CHUNK_SIDE_STREAM=0`). Prints each run, then per setting the median wall
time and output tok/s. Quote `batchgen bench` runs, not these, as results.
"""

from __future__ import annotations

import gc
import importlib
import os
import statistics
import sys

import torch

from batchgen.bench.engine_run import build_bench, run_engine
from batchgen.bench.random_model import preset_config
from batchgen.bench.workloads import build_workload
from batchgen.config import EngineConfig


def parse(setting: str) -> dict[str, int]:
    if setting == "default":
        return {}
    pairs = (item.split("=", 1) for item in setting.split(","))
    return {key: int(value) for key, value in pairs}


def patch_constants(constants: dict[str, int]) -> dict:
    """Set MODULE.NAME constants of batchgen.engine (and every engine module's imported copy);
    a dotted MODULE (`layers.attention`) names a module under batchgen instead. Returns the old
    values for restore."""
    old = {}
    modules = [m for n, m in sys.modules.items() if n.startswith("batchgen.")]
    for key, value in constants.items():
        module_name, name = key.rsplit(".", 1)
        package = "batchgen" if "." in module_name else "batchgen.engine"
        owner = importlib.import_module(f"{package}.{module_name}")
        old[key] = getattr(owner, name)
        for module in modules + [owner]:
            if getattr(module, name, None) == old[key]:
                setattr(module, name, value)
    return old


def main() -> None:
    preset, rounds, settings = sys.argv[1], int(sys.argv[2]), sys.argv[3:] or ["default"]
    vocab = preset_config(preset)["vocab_size"]
    name, _, count = os.environ.get("SWEEP_WORKLOAD", "nano").partition(":")
    w = build_workload(name, vocab, int(count) if count else None)
    walls: dict[str, list[float]] = {s: [] for s in settings}
    for setting in settings:
        options = parse(setting)
        constants = {k: options.pop(k) for k in list(options) if "." in k}
        old = patch_constants(constants)
        config = EngineConfig(model="-", dtype="bfloat16", device="cuda", **options)
        bench = build_bench(config, preset, None, w.max_request_len())
        if bench.runner.tune_report is not None:
            print(f"{setting}: {bench.runner.tune_report}", flush=True)
        for r in range(rounds):
            result = run_engine(bench, w)
            walls[setting].append(result.wall_s)
            rate = result.output_tokens / result.wall_s
            print(
                f"round {r} {setting:<48} {result.wall_s:6.2f} s {rate:9,.0f} tok/s "
                f"{result.steps} steps {result.preemptions} preemptions",
                flush=True,
            )
        del bench
        patch_constants(old)
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{preset}: median of {rounds}")
    for setting, values in walls.items():
        wall = statistics.median(values)
        print(f"  {setting:<48} {wall:6.2f} s {w.num_output_tokens / wall:9,.0f} tok/s")


if __name__ == "__main__":
    main()
