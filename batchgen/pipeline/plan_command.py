"""`batchgen plan JOB`: claim the output directory and make the job's shard plan, no model."""

from __future__ import annotations

import os
from collections.abc import Callable

from batchgen.io import locks
from batchgen.io.arrow_types import describe
from batchgen.io.shard_plan import PLAN_FILE
from batchgen.job import JobSpec
from batchgen.pipeline.job_plan import Stopped
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.signals import EX_TEMPFAIL, StopFlag


def make_plan(job: JobSpec, overwrite: bool, stop: StopFlag, log: Callable) -> list[str]:
    """Run every check a run makes before loading the model, then read or make the plan;
    returns the summary lines."""
    runner = Runner(job, overwrite=overwrite, stop=stop, log=log)
    try:
        runner.prepare()
    except Stopped:
        return [f"interrupted by {stop.signal_name}; run the same command again (exit 75)"]
    finally:
        if runner.renderer is not None:
            runner.renderer.close()  # ends the chat-template worker
        if runner.keeper is not None:
            runner.keeper.close()
            locks.tidy(job.output.path)
    plan = runner.plan
    if stop.is_set():
        return [f"interrupted by {stop.signal_name} (exit {EX_TEMPFAIL})"]
    lines = [
        f"plan: {os.path.join(job.output.path, PLAN_FILE)}: {plan.num_units} "
        f"{runner.mode.unit_kind()} in {plan.num_shards} shard(s) of {plan.shard_rows}, "
        f"{len(plan.duplicates)} duplicate id(s)",
    ]
    for name, t in plan.columns.items():
        lines.append(f"  column {name}: {describe(t)}")
    lines += plan.notes
    return lines
