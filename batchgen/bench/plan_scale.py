"""Host-side scale check of shard planning and manifest handling (no model, no GPU).

    python -m batchgen.bench.plan_scale --rows 100000000 --shards 10000 --dir /tmp/plan-scale

1. Writes a synthetic JSONL input (`--files` files; rows hold an id, a number and a short
   text; one id in 10,000 repeats an earlier one) unless it is already there.
2. Makes the shard plan as a run's first task does (the scan, exact duplicate ids, column
   types), recording wall time, this process's peak RSS above its start (where the id hashes
   live: 8 bytes a row, 16 while sorting) and the scan workers' peak RSS.
3. Manifest handling for that many shards: one entry and one (one-row) part file per shard,
   then times reading the plan, a task's seek to its last shard, verifying every entry
   (what _SUCCESS needs) and `batchgen status`.
Prints one line per figure and writes them to DIR/plan_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io import locks, manifest
from batchgen.io.readers import resolve_inputs
from batchgen.io.shard_plan import read_plan
from batchgen.job.spec import InputSpec, JobSpec, ModelSpec, OutputSpec, PromptSpec, SamplingSpec
from batchgen.pipeline.fingerprint import fingerprint_parts
from batchgen.pipeline.job_plan import default_workers, ensure_plan
from batchgen.pipeline.modes import mode_for
from batchgen.pipeline.signals import StopFlag

DUP_EVERY = 10_000  # one id in this many repeats an earlier one


def rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def write_input(root: str, rows: int, files: int) -> list[str]:
    paths = [os.path.join(root, f"in-{i:03d}.jsonl") for i in range(files)]
    if all(os.path.exists(p) for p in paths):
        return paths
    per_file = -(-rows // files)
    i = 0
    for path in paths:
        with open(path + ".tmp", "w") as f:
            stop = min(rows, i + per_file)
            while i < stop:
                block = range(i, min(stop, i + 100_000))
                f.write(
                    "".join(
                        f'{{"id":"d{j - 5_000 if j % DUP_EVERY == DUP_EVERY - 1 else j:012d}",'
                        f'"n":{j},"text":"row {j} of the synthetic input"}}\n'
                        for j in block
                    )
                )
                i = block.stop
        os.replace(path + ".tmp", path)
    return paths


def job_for(root: str, rows: int, shards: int) -> JobSpec:
    return JobSpec(
        model=ModelSpec(path=os.path.join(root, "no-model")),
        input=InputSpec(path=os.path.join(root, "in-*.jsonl"), columns=("n",)),
        prompt=PromptSpec(template="{text}"),
        sampling=SamplingSpec(),
        output=OutputSpec(path=os.path.join(root, "out"), shard_rows=-(-rows // shards)),
    )


def plan_input(job: JobSpec, files: list[str], workers: int, report: dict) -> None:
    mode = mode_for(job)
    formats = ["jsonl"] * len(files)
    columns = mode.columns(files, formats)
    os.makedirs(job.output.path, exist_ok=True)
    for name in os.listdir(job.output.path):
        if name == "_plan.json":
            os.unlink(os.path.join(job.output.path, name))
    keeper = locks.LeaseKeeper()
    base = current_rss_mb()
    start = time.monotonic()
    fingerprint = fingerprint_parts(job, files)["input"]
    plan = ensure_plan(
        job, mode, files, formats, columns, fingerprint, StopFlag(), keeper,
        log=lambda m: print(m, flush=True), workers=workers,
    )  # fmt: skip
    keeper.close()
    report.update(
        plan_s=round(time.monotonic() - start, 1),
        workers=workers,
        rows=plan.num_units,
        shards=plan.num_shards,
        duplicates=len(plan.duplicates),
        peak_rss_mb=round(rss_mb(), 1),
        rss_before_plan_mb=round(base, 1),
        peak_rss_above_start_bytes_per_row=round((rss_mb() - base) * 2**20 / plan.num_units, 2),
        worker_peak_rss_mb=round(rss_mb(resource.RUSAGE_CHILDREN), 1),
        plan_file_mb=round(os.path.getsize(os.path.join(job.output.path, "_plan.json")) / 2**20, 2),
    )


def manifest_handling(job: JobSpec, report: dict) -> None:
    out = job.output.path
    plan = read_plan(out)
    fp = "f" * 16
    start = time.monotonic()
    os.makedirs(os.path.join(out, manifest.MANIFEST_DIR), exist_ok=True)
    table = pa.table({"id": ["x"]})
    for k in range(plan.num_shards):
        name = f"part-{k:05d}.parquet"
        pq.write_table(table, os.path.join(out, name))
        size = os.path.getsize(os.path.join(out, name))
        manifest.write_entry(out, k, {"file": name, "size": size, "rows": 1, "fingerprint": fp,
                                      "ok": 1, "errors": 0})  # fmt: skip
    report["write_entries_s"] = round(time.monotonic() - start, 1)
    timed = {}
    t = time.monotonic()
    plan = read_plan(out)
    timed["read_plan_s"] = time.monotonic() - t
    t = time.monotonic()
    k = plan.num_shards - 1
    mode = mode_for(job)
    first, stop = plan.shard_units(k)
    files = resolve_inputs(job.input.path)
    reader = mode.reader(
        files,
        mode.columns(files, ["jsonl"] * len(files)),
        start=plan.starts[k],
        first_index=first,
        limit=stop - first,
        duplicates=plan.duplicates_in(k),
    )
    units = sum(len(c) for c in reader)
    assert units == stop - first
    timed["seek_and_read_last_shard_s"] = time.monotonic() - t
    t = time.monotonic()
    entries = manifest.entry_names(out)
    timed["list_entries_s"] = time.monotonic() - t
    assert len(entries) == plan.num_shards
    t = time.monotonic()
    done = manifest.committed_shards(out, fp)
    timed["verify_all_entries_s"] = time.monotonic() - t
    assert len(done) == plan.num_shards
    t = time.monotonic()
    own = manifest.committed_shards(out, fp, lambda s: s % 1000 == 7)
    timed["verify_one_tasks_entries_of_1000_tasks_s"] = time.monotonic() - t
    assert len(own) == len(range(7, plan.num_shards, 1000))
    from batchgen.pipeline.status import status_lines

    manifest.write_job(out, {"fingerprint": fp, "parts": {}, "num_shards": plan.num_shards})
    t = time.monotonic()
    status_lines(out)
    timed["status_s"] = time.monotonic() - t
    report.update({key: round(v, 3) for key, v in timed.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000_000)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--dir", required=True, help="work directory (input, output, report)")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    report: dict = {"host_cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0]}
    start = time.monotonic()
    write_input(args.dir, args.rows, args.files)
    files = resolve_inputs(job_for(args.dir, 1, 1).input.path)
    report["input_gb"] = round(sum(os.path.getsize(f) for f in files) / 1e9, 2)
    report["write_input_s"] = round(time.monotonic() - start, 1)
    job = job_for(args.dir, args.rows, args.shards)
    plan_input(job, files, args.workers, report)
    manifest_handling(job, report)
    report["load_avg_at_end"] = os.getloadavg()[0]
    for key, value in report.items():
        print(f"{key}: {value}")
    with open(os.path.join(args.dir, "plan_scale.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
