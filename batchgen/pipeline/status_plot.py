"""`batchgen status OUT --plot FILE.png`: generated tok/s and rows done over time, as a PNG.

Drawn from the commit events of the job's manifest entries and pieces (timeline.py) with
matplotlib's Agg backend (no display needed). matplotlib is the optional extra
`batchgen[plot]`.
"""

from __future__ import annotations

import datetime as dt
import os

from batchgen.io import manifest
from batchgen.io.shard_plan import read_plan
from batchgen.job import JobError
from batchgen.pipeline.timeline import job_events, rows_done, throughput

SIZE_IN = (10.0, 6.0)  # inches; at DPI, a 1000 x 600 pixel image
DPI = 100
MAX_RUN_MARKS = 20  # run starts drawn as vertical lines when there are at most this many


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise JobError(
            "--plot needs matplotlib, which is not installed: pip install 'batchgen[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def write_plot(out_dir: str, path: str) -> str:
    """Write the PNG to `path`; returns a line saying what it holds. JobError when there is
    nothing to draw yet, or matplotlib is missing."""
    plt = _pyplot()
    job = manifest.read_job(out_dir)
    if job is None:
        raise JobError(f"{out_dir}: no batchgen output here (no {manifest.JOB_FILE})")
    events, untimed = job_events(out_dir, job["fingerprint"])
    if not events:
        raise JobError(f"{out_dir}: no commit with a timeline yet, nothing to plot")
    plan = read_plan(out_dir)
    total_rows = plan.num_units if plan is not None else job.get("total_rows")

    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter, date2num

    def when(t: float) -> float:
        """A unix time as matplotlib's date number (local time)."""
        return float(date2num(dt.datetime.fromtimestamp(t)))

    edges, rates = throughput(events, bins=min(100, max(10, 2 * len(events))))
    times, counts = rows_done(events)
    runs = sorted({e.run_started for e in events})
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=SIZE_IN, dpi=DPI)
    try:
        # Throughput: a step per bin, the value holding over the bin.
        xs = [when(t) for t in edges]
        top.stairs(rates, xs, fill=True, alpha=0.35, color="tab:blue")
        top.stairs(rates, xs, color="tab:blue")
        top.set_ylabel("generated tok/s")
        top.set_ylim(bottom=0)
        span = edges[-1] - edges[0]
        tokens = sum(e.generated_tokens for e in events)
        top.set_title(
            f"{os.path.basename(os.path.normpath(out_dir))}: {tokens} tokens generated, "
            f"{tokens / span if span > 0 else 0.0:.1f} tok/s on average over {_duration(span)}"
        )
        # Rows done: each commit adds its rows.
        bottom.step([xs[0]] + [when(t) for t in times], [0] + counts, where="post", color="k")
        label = f"{counts[-1]} rows done"
        if total_rows:
            bottom.axhline(total_rows, color="tab:green", linestyle="--", label="rows in the job")
            label += f" of {total_rows} ({counts[-1] / total_rows:.0%})"
        bottom.set_ylabel("rows done")
        bottom.set_ylim(bottom=0)
        bottom.set_title(label, fontsize="medium")
        if len(runs) <= MAX_RUN_MARKS:
            for ax in (top, bottom):
                for t in runs:
                    ax.axvline(when(t), color="0.6", linestyle=":", linewidth=1)
        bottom.plot([], [], color="0.6", linestyle=":", label="a run starts")
        bottom.legend(loc="lower right", fontsize="small")
        bottom.xaxis_date()
        locator = AutoDateLocator()
        bottom.xaxis.set_major_locator(locator)
        bottom.xaxis.set_major_formatter(ConciseDateFormatter(locator))
        bottom.set_xlabel("time (local)")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    note = f"; {untimed} shard(s) committed without a timeline are not drawn" if untimed else ""
    return f"plot: wrote {path} ({len(events)} commit(s) from {len(runs)} run(s){note})"
