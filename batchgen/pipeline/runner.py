"""Runner: streams a job's input through planner and engine into committed output shards."""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.io import manifest
from batchgen.io.parquet_schema import parquet_schema
from batchgen.io.readers import file_format, resolve_inputs
from batchgen.io.rows import InputRow, ResultRow
from batchgen.io.writer import ShardLayout, write_shard
from batchgen.job import JobError, JobSpec
from batchgen.pipeline import engine_factory as factory
from batchgen.pipeline import kv_scales_file
from batchgen.pipeline.fingerprint import fingerprint, fingerprint_parts
from batchgen.pipeline.job_limits import check_job_limits
from batchgen.pipeline.model_source import resolve_job_model
from batchgen.pipeline.modes import mode_for
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.sharding import ShardSelector
from batchgen.pipeline.signals import EX_TEMPFAIL, GracefulStop, StopFlag
from batchgen.pipeline.stats import RunStats, job_totals, summary_lines, write_stats
from batchgen.plan.planner import Request
from batchgen.plan.prompts import PromptError, PromptRenderer, RenderStopped, TemplateLimits


@dataclass
class RunResult:
    exit_code: int  # 0 done (row errors included) or 75 interrupted; the CLI applies --strict
    stats: RunStats
    totals: dict  # the whole job's: every committed shard, of every task
    task_totals: dict  # this task's own shards (committed by this run or an earlier one)
    num_shards: int | None
    complete: bool  # every shard of the whole job is committed (_SUCCESS written)
    lines: list[str] = field(default_factory=list)


@dataclass
class _Shard:
    k: int
    rows: int  # input units: rows (or groups, score mode's group layout)
    results: list[ResultRow]  # or ScoreRows in score mode
    pending: int
    admitted: int = 0


def passthrough_dtypes(formats: dict[str, str], columns, log) -> list[tuple[str, object]]:
    """(column, dtype) per passthrough column: the dtype the Parquet inputs declare when all
    inputs are Parquet and agree on it, else None (written as text, the same in every shard)."""
    found: dict[str, dict[object, str]] = {c: {} for c in columns}
    parquet_only = all(fmt == "parquet" for fmt in formats.values())
    for f in formats if parquet_only else ():
        schema = parquet_schema(f)
        for c in columns:
            if c in schema:
                found[c].setdefault(schema[c], f)
    out = []
    for c in columns:
        kinds = found[c]
        if len(kinds) > 1:
            seen = ", ".join(f"{dtype} in {f}" for dtype, f in kinds.items())
            log(f"input: column {c!r} has several types ({seen}); it is written as text")
        out.append((c, next(iter(kinds)) if len(kinds) == 1 else None))
    return out


class Runner:
    """Runs one task of a job (all shards, or those selected by `shard`).

    Args:
        job: the validated job.
        shard: which shards this task owns.
        overwrite: discard outputs of a different job (or a foreign non-empty directory).
        engine_factory / tokenizer_factory: build the engine / tokenizer (default: the real ones
            in engine_factory.py; tests pass fakes).
        stop: the stop flag; stop signals set it while `run` is active.
        progress: show a tqdm bar on stderr.
        grace_s: after a stop request, how long in-flight shards may take to finish.
        max_in_flight: most requests inside the engine (default 4 x max_num_seqs).
        log: where messages go (default stderr).
        template_limits: hard limits on each chat-template render (default TemplateLimits()).
    """

    def __init__(
        self,
        job: JobSpec,
        shard: ShardSelector | None = None,
        overwrite: bool = False,
        engine_factory: Callable[[JobSpec], factory.EngineLike] | None = None,
        tokenizer_factory: Callable[[JobSpec], factory.TokenizerLike] | None = None,
        stop: StopFlag | None = None,
        progress: bool = False,
        grace_s: float = 20.0,
        max_in_flight: int | None = None,
        chunk_rows: int = 1024,
        log: Callable[[str], None] | None = None,
        template_limits: TemplateLimits | None = None,
    ):
        self.job = job
        self.mode = mode_for(job)  # what differs between generate and score
        self.shard = shard or ShardSelector()
        self.overwrite = overwrite
        # Looked up at call time so tests can swap engine_factory.build_engine / build_tokenizer.
        self.engine_factory = engine_factory or factory.build_engine
        self._check_model = engine_factory is None  # the real model: read its config up front
        self.tokenizer_factory = tokenizer_factory or factory.build_tokenizer
        self.stop = stop or StopFlag()
        self.progress_enabled = progress
        self.grace_s = grace_s
        self.max_in_flight = max_in_flight or 4 * job.model.engine_config().max_num_seqs
        self.chunk_rows = chunk_rows
        self.template_limits = template_limits
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.out_dir = job.output.path

    # ----------------------------------------------------------------------------- preparation

    def prepare(self) -> None:
        """Every check that needs no model weights; raises JobError. Then claims the out dir."""
        job = self.job = resolve_job_model(self.job)  # a hub id: its snapshot directory
        self.files = resolve_inputs(job.input.path)
        self.formats = {f: file_format(f, job.input.format) for f in self.files}
        self.columns = self.mode.columns(self.files, list(self.formats.values()))
        tok = self.tokenizer = self.tokenizer_factory(job)
        if self._check_model:
            # config.json: architecture, lengths, vocabulary (JobError if bad), and the job's
            # own settings against them, before the weights load.
            check_job_limits(job, factory.model_limits(job))
        # Chat templates render in a worker process that a stop signal kills at once.
        self.renderer = PromptRenderer(
            job.prompt,
            tok.chat_template,
            tok.bos_token,
            tok.eos_token,
            limits=self.template_limits,
            should_stop=self.stop.is_set,
        )
        try:
            self.renderer.check(needs_chat=job.prompt.chat is not None)
        except PromptError as e:
            raise JobError(f"prompt: {e}") from None
        except RenderStopped:
            pass  # the stop flag ends the run before any row is read
        self.parts = self.mode.fingerprint_parts(fingerprint_parts(job, self.files, self.log))
        self.fingerprint = fingerprint(self.parts)
        self._check_output_apart()
        self._claim_output_dir()
        manifest.remove_stray_temps(self.out_dir, self.shard.owns)
        self.committed = manifest.committed_shards(self.out_dir, self.fingerprint)

    def _check_output_apart(self) -> None:
        """The output directory (and its _manifest/) must hold no input file: shards, temps and
        --overwrite would replace or delete it."""
        out = self.out_dir
        if os.path.exists(out) and not os.path.isdir(out):
            raise JobError(f"output.path: {out!r} exists and is not a directory")
        real_out = os.path.realpath(out)
        homes = (real_out, os.path.join(real_out, manifest.MANIFEST_DIR))
        for f in self.files:
            if os.path.dirname(os.path.realpath(f)) in homes:
                raise JobError(
                    f"output.path: {out!r} holds the input file {f}; write the output to a "
                    "directory of its own"
                )

    def _claim_output_dir(self) -> None:
        out = self.out_dir
        os.makedirs(out, exist_ok=True)
        manifest.check_no_links(out)  # before anything in it is read, written or cleared
        old = manifest.read_job(out)
        # Only batchgen's own names (a first run killed mid-write leaves just a temp of
        # _job.json; a concurrent task may be writing one now) do not make it foreign.
        if manifest.foreign_names(out) and not manifest.is_batchgen_dir(out):
            if not self.overwrite:
                raise JobError(
                    f"output.path: {out!r} is not empty and holds no batchgen output; choose "
                    "an empty or new directory, or pass --overwrite"
                )
            manifest.clear_outputs(out)
        elif old is not None and old.get("fingerprint") != self.fingerprint:
            changed = [k for k, v in self.parts.items() if old.get("parts", {}).get(k) != v]
            if not self.overwrite:
                raise JobError(
                    f"output.path: {out!r} holds results of a different job (changed: "
                    f"{', '.join(changed) or 'unknown'}); pass --overwrite to discard them, "
                    "or use another output.path"
                )
            self.log(f"--overwrite: discarding old outputs in {out} (changed: {changed})")
            manifest.clear_outputs(out)
            old = None
        if old is None:
            manifest.write_job(out, self._job_record(None, None))

    def _job_record(self, total_rows: int | None, num_shards: int | None) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "parts": self.parts,
            "job_file": self.job.source,
            "model": self.job.model.path,
            "inputs": self.files,
            "shard_rows": self.job.output.shard_rows,
            "format": self.job.output.format,
            "total_rows": total_rows,
            "num_shards": num_shards,
        }

    # ------------------------------------------------------------------------------- running

    def run(self) -> RunResult:
        """Prepare, then process every owned shard not yet committed."""
        start = time.monotonic()
        # Stop signals are caught from start to end: one during preparation also exits 75, and
        # one while the totals, _SUCCESS and _stats.json are written neither kills the process
        # mid-write (a temp file left, no _SUCCESS) nor changes the exit code.
        with GracefulStop(self.stop):
            self.renderer: PromptRenderer | None = None
            try:
                self.prepare()
                # This task's shards' entries: what it reports and --strict decides on. Other
                # tasks' rows are theirs to report; a resumed task still counts its earlier
                # runs'.
                self.own_entries = {k: e for k, e in self.committed.items() if self.shard.owns(k)}
                self.stats = RunStats(shards_skipped=len(self.own_entries))
                self.progress = Progress(self.progress_enabled)
                self.engine = None
                self.layout = self._layout()
                try:
                    finished = self._loop()
                finally:
                    self.progress.close()
            finally:
                if self.renderer is not None:
                    self.renderer.close()  # ends the chat-template worker
            return self._finish(finished, start)

    def _finish(self, finished: bool, start: float) -> RunResult:
        """Record the job's totals, _SUCCESS if every shard is done, and the run's stats."""
        self.stats.wall_s = time.monotonic() - start
        num_shards, complete = None, False
        if finished:
            total = self.reader._next_index
            num_shards = math.ceil(total / self.job.output.shard_rows)
            manifest.write_job(self.out_dir, self._job_record(total, num_shards))
            complete = manifest.mark_success_if_complete(self.out_dir, self.fingerprint, num_shards)
        stats = write_stats(
            self.out_dir,
            self.stats,
            lambda: manifest.committed_shards(self.out_dir, self.fingerprint),
            str(self.shard),
        )
        task_totals = job_totals(self.own_entries)
        lines = summary_lines(self.stats, task_totals, stats["job"], num_shards, self.shard)
        if not finished:
            lines.append(
                f"interrupted by {self.stop.signal_name}: committed shards are kept; "
                f"run the same command again to resume (exit {EX_TEMPFAIL})"
            )
        code = 0 if finished else EX_TEMPFAIL
        return RunResult(code, self.stats, stats["job"], task_totals, num_shards, complete, lines)

    def _layout(self) -> ShardLayout:
        passthrough = tuple(passthrough_dtypes(self.formats, self.job.input.columns, self.log))
        return self.mode.layout(passthrough, self.job.model.name)

    def _planner(self):
        if self.engine is None:
            self.log(f"loading model {self.job.model.path} ...")
            self.engine = self.engine_factory(self.job)
            # The engine's own limits: rows it would refuse become error records up front; and
            # its grammar compiler, so a shard's new constraints compile as it is planned.
            check = getattr(self.engine, "check_structured_outputs", None)
            self._plan = self.mode.planner(
                self.renderer, self.tokenizer, self.engine.limits, structured_check=check
            )
            self._set_kv_scales()
        return self._plan

    def _set_kv_scales(self) -> None:
        """model.calibrate_kv_scales N: the FP8 K/V scales of the job's first N input rows
        (in input order, whatever this task's shards), calibrated once and kept in the output
        directory; every task and resume loads them from there before anything runs."""
        count = self.job.model.engine_config().calibrate_kv_scales
        if not count:
            return
        scales = kv_scales_file.read(self.out_dir, self.fingerprint)
        if scales is None:
            sample = self._first_prompts(count)
            self.log(f"calibrating FP8 K/V scales on the first {len(sample)} prompt(s) ...")
            computed = self.engine.calibrate_kv_scales(sample)
            record = {
                "fingerprint": self.fingerprint,
                "num_prompts": len(sample),
                "num_tokens": sum(map(len, sample)),
                "scales": [list(pair) for pair in computed],
            }
            kv_scales_file.write_if_absent(self.out_dir, record)
            scales = kv_scales_file.read(self.out_dir, self.fingerprint)
            if scales is None:
                raise JobError(f"output.path: cannot read back {kv_scales_file.KV_SCALES_FILE}")
        self.engine.set_kv_scales([tuple(pair) for pair in scales])

    def _first_prompts(self, count: int) -> list[list[int]]:
        """Prompt token ids of the first `count` input rows that plan into requests."""
        planner = self.mode.planner(self.renderer, self.tokenizer, self.engine.limits)
        prompts: list[tuple[int, list[int]]] = []
        for chunk in self.mode.reader(self.files, self.columns, self.chunk_rows):
            plan = planner.plan(chunk)
            prompts += [(r.index, r.prompt_token_ids) for r in plan.requests]
            if len(prompts) >= count:
                break
        if not prompts:
            raise JobError("model.calibrate_kv_scales: no input row gives a prompt to calibrate on")
        return [ids for _, ids in sorted(prompts, key=lambda p: p[0])[:count]]

    def _loop(self) -> bool:
        """Feed, step and commit until done (True) or stopped (False)."""
        self.reader = self.mode.reader(self.files, self.columns, self.chunk_rows)
        self._chunks = iter(self.reader)
        self._buffer: tuple[int, list[InputRow]] | None = None
        self._queue: deque[tuple[int, Request]] = deque()
        self._open: dict[int, _Shard] = {}
        self._in_flight: dict[str, tuple[int, Request]] = {}
        self._dropped = False  # a stop dropped shards that were never started
        input_done = False
        deadline = None
        while True:
            if self.stop.is_set() and deadline is None:
                deadline = time.monotonic() + self.grace_s
                self.log(
                    f"{self.stop.signal_name}: no new rows; finishing in-flight shards "
                    f"(up to {self.grace_s:.0f} s)"
                )
                self._drop_unstarted_shards()
            while (
                deadline is None
                and not input_done
                and not self.stop.is_set()
                and len(self._queue) < self.max_in_flight
            ):
                input_done = not self._read_chunk()
            self._admit(stopping=deadline is not None)
            if not self._in_flight:
                if deadline is not None:
                    # Finished only if the stop dropped nothing: shards read but never
                    # started are still owed (exit 75, so a scheduler requeues the task).
                    return input_done and not self._open and not self._dropped
                if input_done:
                    return not self._dropped  # a stop may have dropped the last shard
                continue
            for out in self.engine.step():
                k, req = self._in_flight.pop(out.request_id)
                self._add_results(k, self.mode.results(req, out))
            if deadline is not None and time.monotonic() > deadline:
                if self._open:
                    self.log(f"abandoning {len(self._open)} unfinished shard(s) uncommitted")
                return False

    def _read_chunk(self) -> bool:
        """Read one input chunk into shard buffers; False at the end of the input."""
        chunk = next(self._chunks, None)
        if chunk is None:
            self._close_buffer()
            return False
        size = self.job.output.shard_rows
        for row in chunk:
            k = row.index // size
            if not self.shard.owns(k) or k in self.committed:
                continue
            if self._buffer is None or self._buffer[0] != k:
                self._close_buffer()
                self._buffer = (k, [])
            self._buffer[1].append(row)
        if self._buffer is not None and len(self._buffer[1]) == size:
            self._close_buffer()
        return True

    def _close_buffer(self) -> None:
        """A shard's rows are all read: plan it and queue its requests."""
        if self._buffer is None:
            return
        k, rows = self._buffer
        self._buffer = None
        try:
            plan = self._planner().plan(rows)
        except RenderStopped:  # a stop killed the chat template mid-shard: the shard is owed
            self._dropped = True
            return
        self._open[k] = _Shard(k, len(rows), list(plan.errors), len(plan.requests))
        self.progress.update(len({e.index for e in plan.errors}), 0)
        self._queue.extend((k, r) for r in plan.requests)
        if not plan.requests:
            self._commit(k)

    def _admit(self, stopping: bool) -> None:
        while self._queue and len(self._in_flight) < self.max_in_flight:
            k, req = self._queue[0]
            if stopping and (k not in self._open or self._open[k].admitted == 0):
                break
            self._queue.popleft()
            rid = f"{k}/{req.index}"
            self._in_flight[rid] = (k, req)
            self._open[k].admitted += 1
            self.mode.submit(self.engine, rid, req)

    def _drop_unstarted_shards(self) -> None:
        unstarted = [k for k, s in self._open.items() if s.admitted == 0]
        # (A buffer still filling means the input is not done: that run is unfinished anyway.)
        self._dropped = self._dropped or bool(unstarted)
        self._buffer = None
        for k in unstarted:
            del self._open[k]
        self._queue = deque((k, r) for k, r in self._queue if k in self._open)

    def _add_results(self, k: int, results: list[ResultRow]) -> None:
        """The output rows of one finished request (one, or one per candidate)."""
        shard = self._open[k]
        shard.results += results
        shard.pending -= 1
        self.progress.update(1, self.mode.totals(results)["num_generated_tokens"])
        if shard.pending == 0:
            self._commit(k)

    def _commit(self, k: int) -> None:
        shard = self._open.pop(k)
        self.mode.check(k, shard.rows, shard.results)
        entry = write_shard(self.out_dir, k, shard.results, self.layout)
        entry.update(fingerprint=self.fingerprint, rows=shard.rows)
        entry.update(self.mode.totals(shard.results))  # score mode: rows = rows in the file
        manifest.write_entry(self.out_dir, k, entry)
        self.own_entries[k] = entry
        self.stats.add_shard(entry)
