"""Runner: streams a job's input through planner and engine into committed output shards."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.io import locks, manifest, pieces
from batchgen.io.claim import claim_output
from batchgen.io.readers import file_format, resolve_inputs
from batchgen.io.rows import InputRow
from batchgen.io.shard_plan import ShardPlan
from batchgen.io.writer import OUTPUT_VERSION
from batchgen.job import JobError, JobSpec
from batchgen.pipeline import engine_factory as factory
from batchgen.pipeline import kv_scales_file
from batchgen.pipeline.fingerprint import fingerprint, fingerprint_parts
from batchgen.pipeline.job_limits import check_job_limits
from batchgen.pipeline.job_plan import Stopped, default_workers, ensure_plan
from batchgen.pipeline.model_source import resolve_job_model
from batchgen.pipeline.modes import mode_for
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.shard_commit import ShardCommitter
from batchgen.pipeline.shard_loop import ShardLoop
from batchgen.pipeline.sharding import ShardSelector
from batchgen.pipeline.signals import EX_TEMPFAIL, GracefulStop, StopFlag
from batchgen.pipeline.stats import RunStats, job_totals, summary_lines, write_stats
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
        grace_s: after a stop request, how long requests in the engine may still finish before
            every finished row is committed and the run exits.
        checkpoint_s: every this many seconds, the finished rows of unfinished shards are
            committed as pieces (None: only on a stop), so a SIGKILL loses at most that much.
        max_in_flight: most requests inside the engine (default 4 x max_num_seqs).
        lease_s: how long a lock of this run stays valid without renewal (renewed every
            quarter of it); other hosts take over a shard whose holder's lease lapsed.
        holder: a note for the lock files (e.g. the Slurm job), shown by `batchgen status`.
        plan_workers: processes that scan the input if this run makes the shard plan
            (default: the CPUs it may use, at most 16).
        log: where messages go (default stderr).
        template_limits: hard limits on each chat-template render (default TemplateLimits()).
        shard_loop: runs the task's remaining shards and says whether all are done (default:
            ShardLoop in this process; data_parallel.WorkerPool hands them to engine workers).
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
        grace_s: float = 5.0,
        checkpoint_s: float | None = 300.0,
        max_in_flight: int | None = None,
        chunk_rows: int = 1024,
        lease_s: float = locks.DEFAULT_LEASE_S,
        holder: str = "",
        plan_workers: int | None = None,
        log: Callable[[str], None] | None = None,
        template_limits: TemplateLimits | None = None,
        shard_loop: Callable[[Runner, list[int]], bool] | None = None,
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
        self.checkpoint_s = checkpoint_s
        self.max_in_flight = max_in_flight or 4 * job.model.engine_config().max_num_seqs
        self.chunk_rows = chunk_rows
        self.lease_s = lease_s
        self.task = f"{self.shard}{' ' + holder if holder else ''}"
        self.template_limits = template_limits
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.out_dir = job.output.path
        self.plan_workers = plan_workers
        self.engine = None
        self.keeper: locks.LeaseKeeper | None = None
        self.renderer: PromptRenderer | None = None
        self.shard_loop = shard_loop or _loop_here
        # (exit code, message) when the shard loop ended short of its shards without a stop
        # signal (data parallel: every worker died, or a shard failed twice).
        self.failure: tuple[int, str] | None = None

    # ----------------------------------------------------------------------------- preparation

    def prepare(self) -> None:
        """Every check that needs no model weights (JobError if one fails), then claim the
        output directory, read or make the shard plan and find what is committed. Raises
        Stopped if a stop signal comes first."""
        job = self.job = resolve_job_model(self.job)  # a hub id: its snapshot directory
        self.files = resolve_inputs(job.input.path)
        self.formats = [file_format(f, job.input.format) for f in self.files]
        self.columns = self.mode.columns(self.files, self.formats)
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
        parts = self.mode.fingerprint_parts(fingerprint_parts(job, self.files, self.log))
        self.parts = {**parts, "output.version": str(OUTPUT_VERSION)}
        self.fingerprint = fingerprint(self.parts)
        self._check_output_apart()
        if self.stop.is_set():
            raise Stopped
        self.keeper = locks.LeaseKeeper(self.lease_s)
        run_lock = claim_output(
            self.out_dir, self._job_record(), self.overwrite, self.lease_s, self.task, self.log
        )
        self.keeper.add(run_lock)
        self.plan: ShardPlan = ensure_plan(
            job,
            self.mode,
            self.files,
            self.formats,
            self.columns,
            self.parts["input"],
            self.stop,
            self.keeper,
            self.task,
            self.log,
            self.plan_workers or default_workers(),
        )
        record = manifest.read_job(self.out_dir) or {}
        if record.get("num_shards") != self.plan.num_shards:
            manifest.write_job(self.out_dir, self._job_record(self.plan))
        for note in self.plan.notes:
            self.log(note)
        self.layout = self.mode.layout(tuple(self.plan.columns.items()), job.model.name)
        self.committer = ShardCommitter(
            self.out_dir, self.layout, self.fingerprint, self.mode, self.log, self.task
        )
        self._temps = self._sort_temps()
        self.committed = manifest.committed_shards(self.out_dir, self.fingerprint, self.shard.owns)

    def _check_output_apart(self) -> None:
        """The output directory (and its _manifest/, _partial/) must hold no input file:
        shards, temps and --overwrite would replace or delete it."""
        out = self.out_dir
        if os.path.exists(out) and not os.path.isdir(out):
            raise JobError(f"output.path: {out!r} exists and is not a directory")
        real_out = os.path.realpath(out)
        homes = (
            real_out,
            *(os.path.join(real_out, d) for d in (manifest.MANIFEST_DIR, pieces.PARTIAL_DIR)),
        )
        for f in self.files:
            if os.path.dirname(os.path.realpath(f)) in homes:
                raise JobError(
                    f"output.path: {out!r} holds the input file {f}; write the output to a "
                    "directory of its own"
                )

    def _job_record(self, plan: ShardPlan | None = None) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "parts": self.parts,
            "job_file": self.job.source,
            "model": self.job.model.path,
            "inputs": self.files,
            "shard_rows": self.job.output.shard_rows,
            "format": self.job.output.format,
            "total_rows": None if plan is None else plan.num_units,
            "num_shards": None if plan is None else plan.num_shards,
        }

    def _sort_temps(self) -> dict[int, list[str]]:
        """Remove the temp files no live process can be writing (shared files' temps of ended
        writers, temps of committed shards); keep the rest by shard, to remove once this run
        holds that shard's lock."""
        done = manifest.entry_names(self.out_dir)
        manifest.remove_stray_temps(self.out_dir, done.__contains__)
        by_shard: dict[int, list[str]] = {}
        for d, name, k, _, _ in manifest.list_temps(self.out_dir):
            if k is not None:
                by_shard.setdefault(k, []).append(os.path.join(d, name))
        return by_shard

    # ------------------------------------------------------------------ what the loop calls

    def lock_file(self, k: int) -> str:
        return locks.lock_path(self.out_dir, f"part-{k:05d}.lock")

    def remove_temps_of(self, k: int) -> None:
        """Temps of shard k: debris, now that this run holds its lock."""
        for path in self._temps.pop(k, []):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def planner(self):
        """The request planner (loading the model on first use)."""
        if self.engine is None:
            self.log(f"loading model {self.job.model.path} ...")
            started = time.monotonic()
            self.engine = self.engine_factory(self.job)
            self.log(f"model loaded in {time.monotonic() - started:.1f} s")
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

    def read_shard(self, k: int) -> list[InputRow]:
        """Shard k's units, read from its position in the shard plan."""
        self.committer.note_start(k)  # the start of its rows' interval in the job's timeline
        first, stop = self.plan.shard_units(k)
        # One chunk: the shard is held whole anyway, and a Parquet chunk decodes every row
        # group it touches (chunks smaller than a row group would decode it again and again).
        reader = self.mode.reader(
            self.files,
            self.columns,
            max(self.chunk_rows, stop - first),
            start=self.plan.starts[k],
            first_index=first,
            limit=stop - first,
            duplicates=self.plan.duplicates_in(k),
        )
        units = [u for chunk in reader for u in chunk]
        if len(units) != stop - first:
            raise RuntimeError(
                f"shard {k}: read {len(units)} of its {stop - first} rows; the input changed "
                "since the shard plan was made (run again to plan anew)"
            )
        return units

    def committed_by_entry(self, k: int) -> bool:
        entry = manifest.read_entries_of(self.out_dir, k)
        return entry is not None and manifest.verify_entry(self.out_dir, entry, self.fingerprint)

    def note_committed(self, k: int, entry: dict | None = None, new: dict | None = None) -> None:
        """Shard k is committed (by this run when `new` holds this run's counters)."""
        if entry is None:
            entry = manifest.read_entries_of(self.out_dir, k) or {}
        self.own_entries[k] = entry
        if new:
            self.stats.add_rows(new)
            self.stats.shards_committed += 1
        else:
            self.stats.shards_skipped += 1

    def note_piece(self, k: int, entry: dict, rows: list) -> None:
        self.stats.add_rows(entry)
        self.stats.pieces_committed += 1

    def abandon_lock(self, lock: locks.HeldLock) -> None:
        """The lock of a shard an error left unfinished: released (a data parallel worker
        leaves it to its parent, which decides whether the shard is retried)."""
        self.keeper.release(lock)

    def note_blocked(self, k: int, info: locks.LockInfo) -> None:
        """Shard k is held by another live process (said once per shard)."""
        self.log(f"shard {k} is being written by {info.who()}; skipping it for now")

    def leave_to_holder(self, info: locks.LockInfo) -> bool:
        """Whether a shard whose lock `info` is live is left alone for the rest of this run
        instead of waited for (a data parallel worker leaves the shards its parent set aside)."""
        return False

    def make_progress(self, total: int) -> Progress:
        return Progress(self.progress_enabled, total=total)

    # ------------------------------------------------------------------------------- running

    def run(self) -> RunResult:
        """Prepare, then process every owned shard not yet committed."""
        start = time.monotonic()
        # Stop signals are caught from start to end: one during preparation also exits 75, and
        # one while the totals, _SUCCESS and _stats.json are written neither kills the process
        # mid-write (a temp file left, no _SUCCESS) nor changes the exit code.
        with GracefulStop(self.stop):
            try:
                try:
                    self.prepare()
                except Stopped:
                    return self._stopped_early(start)
                # This task's shards' entries: what it reports and --strict decides on. Other
                # tasks' rows are theirs to report; a resumed task counts its earlier runs'.
                self.own_entries = dict(self.committed)
                self.stats = RunStats(shards_skipped=len(self.own_entries))
                owned = [k for k in range(self.plan.num_shards) if self.shard.owns(k)]
                todo = [k for k in owned if k not in self.committed]
                self.progress = self.make_progress(self._rows_owed(todo))
                try:
                    finished = self.shard_loop(self, todo)
                finally:
                    self.progress.close()
                return self._finish(finished, start)
            finally:
                if self.renderer is not None:
                    self.renderer.close()  # ends the chat-template worker
                if self.keeper is not None:
                    self.keeper.close()
                    locks.tidy(self.out_dir, self.lease_s)

    def _rows_owed(self, todo: list[int]) -> int:
        """Rows (units) of the shards still to do, less those their committed pieces hold:
        what this run will generate, the progress bar's total."""
        held = pieces.list_pieces(self.out_dir, self.fingerprint)
        owed = 0
        for k in todo:
            first, stop = self.plan.shard_units(k)
            owed += stop - first - len(pieces.usable(held.get(k, []))[1])
        return owed

    def _job_entries(self) -> dict[int, dict]:
        """Every shard entry of this job (read, not verified: for the totals only)."""
        entries = manifest.read_entries(self.out_dir)
        return {k: e for k, e in entries.items() if e.get("fingerprint") == self.fingerprint}

    def _stopped_early(self, start: float) -> RunResult:
        stats = RunStats(wall_s=time.monotonic() - start)
        lines = [
            f"interrupted by {self.stop.signal_name} before any shard was started; run the same "
            f"command again (exit {EX_TEMPFAIL})"
        ]
        empty = job_totals({})
        return RunResult(EX_TEMPFAIL, stats, empty, empty, None, False, lines)

    def _finish(self, finished: bool, start: float) -> RunResult:
        """Record _SUCCESS if every shard is done, and the run's stats."""
        self.stats.wall_s = time.monotonic() - start
        num_shards = self.plan.num_shards
        complete = False
        if finished:
            complete = manifest.mark_success_if_complete(self.out_dir, self.fingerprint, num_shards)
            if complete:
                pieces.remove_superseded(self.out_dir, set(range(num_shards)))
        stats = write_stats(
            self.out_dir, self.stats, self._job_entries, str(self.shard), self.fingerprint
        )
        task_totals = job_totals(self.own_entries)
        noop = stats["last_run"] if finished and self.stats.did_nothing else None
        lines = summary_lines(
            self.stats, task_totals, stats["job"], num_shards, self.shard, last_run=noop
        )
        if self.plan.mixed_columns:
            lines.append(
                f"written as text (their values mix kinds): {', '.join(self.plan.mixed_columns)}"
            )
        code = 0 if finished else EX_TEMPFAIL
        if not finished and self.failure is not None:
            code = self.failure[0]
            lines.append(self.failure[1])
        elif not finished:
            lines.append(
                f"interrupted by {self.stop.signal_name}: committed shards and the finished rows "
                f"of unfinished ones are kept; run the same command again to resume "
                f"(exit {EX_TEMPFAIL})"
            )
        return RunResult(code, self.stats, stats["job"], task_totals, num_shards, complete, lines)


def _loop_here(runner: Runner, todo: list[int]) -> bool:
    return ShardLoop(runner, todo).run()
