"""Run `batchgen run` as a subprocess, interrupt it at a planned moment, rerun until it is done.

A `Kill` names the moment: a delay after process start, after the run committed some more
shards, or the instant a temp file of a commit appears (mid-commit; right after that commit
when the poller missed its temp file).
Graceful stops (SIGTERM / SIGINT) are only sent while the run is inside `Runner.run` (its stop
handlers installed, read from /proc, or one of its temp files present): outside it (imports,
the last output lines) the README promises nothing for them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# One torch thread per run: two sharded tasks share the 2-core CI machine, and torch's default
# thread pool made a 1 s run take 2-20 s when other processes were busy.
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
POLL_S = 0.0005  # a shard's temp file lives a few ms (write + fsync)
RUN_TIMEOUT_S = 600  # a hang detector: a loaded 2-core machine must never reach it
GRACEFUL = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class Kill:
    """When and how to interrupt one run.

    The trigger is the first that applies: `temp` (a temp file of this process whose name
    matches this regex appears), `entries` (this run committed that many more of the task's
    shards, or all of them), else process start (for graceful signals: the moment the stop
    handlers are installed). Then `after_s`.
    """

    sig: signal.Signals
    after_s: float = 0.0
    entries: int = 0
    temp: str | None = None


@dataclass
class Task:
    """One `batchgen run` command line (optionally one `--shard I/N`) on a shared output."""

    cwd: Path
    job: Path
    num_shards: int
    shard: tuple[int, int] = (0, 1)
    log: list[dict] = field(default_factory=list)  # one record per run

    @property
    def out(self) -> Path:
        return self.cwd / "out"

    def owned(self) -> list[int]:
        i, n = self.shard
        return [k for k in range(self.num_shards) if k % n == i]

    def committed(self) -> int:
        return len(self.owned()) - len(self.uncommitted())

    def uncommitted(self) -> list[int]:
        have = entries(self.out)
        return [k for k in self.owned() if f"part-{k:05d}.json" not in have]

    def start(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "batchgen", "run", str(self.job), "--no-progress"]
        cmd += ["--shard", f"{self.shard[0]}/{self.shard[1]}"]
        return subprocess.Popen(
            cmd, cwd=self.cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )


def entries(out: Path) -> set[str]:
    """Names of the manifest entries renamed into place (temps start with '.')."""
    try:
        return {n for n in os.listdir(out / "_manifest") if not n.startswith(".")}
    except FileNotFoundError:
        return set()


def listing(out: Path) -> list[tuple[Path, str]]:
    """(directory, name) of every file of the output and its manifest (one listdir each)."""
    found = []
    for d in (out, out / "_manifest"):
        try:
            found += [(d, n) for n in os.listdir(d)]
        except FileNotFoundError:
            continue
    return found


def own_temps(out: Path, pid: int, files: list[tuple[Path, str]] | None = None) -> list[str]:
    """Temp files written by process `pid` (atomic.temp_path puts the pid in the name), from
    `files` (a listing()) or a fresh listing."""
    mark = f".tmp-{pid}-"
    return [n for _, n in (listing(out) if files is None else files) if mark in n]


def final_name(temp: str) -> re.Pattern:
    r"""The final names of the commits whose temp names match `temp` (temp regexes are
    r"\.NAME\.tmp-", as atomic.temp_path names them)."""
    return re.compile(temp.removeprefix(r"\.").removesuffix(r"\.tmp-") + "$")


def committed_files(files: list[tuple[Path, str]], final: re.Pattern) -> dict[str, int]:
    """The files of a listing() whose names match `final`, with their modification times."""
    found = {}
    for d, n in files:
        if final.match(n):
            try:
                found[f"{d.name}/{n}"] = os.stat(d / n).st_mtime_ns
            except FileNotFoundError:
                continue
    return found


def stop_handlers_installed(pid: int) -> bool:
    """True while SIGTERM is caught (Python installs no SIGTERM handler of its own)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(x for x in f if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def wait_for(proc: subprocess.Popen, ready) -> bool:
    """Poll until `ready()`; False if the process ended first."""
    while proc.poll() is None:
        if ready():
            return True
        time.sleep(POLL_S)
    return False


def interrupt(task: Task, proc: subprocess.Popen, kill: Kill) -> bool:
    """Deliver `kill` to `proc` at its moment; True if it was sent to a live process."""
    pid, start = proc.pid, time.monotonic()
    graceful = kill.sig in GRACEFUL
    if graceful and not wait_for(proc, lambda: stop_handlers_installed(pid)):
        return False
    if kill.temp is not None:
        # Mid-commit: the temp file exists. Its window is a few ms; when the poller misses it (a
        # loaded 2-core machine), the commit it belonged to has completed: kill right after it
        # instead (a once-only commit such as _job.json would otherwise let the run finish).
        final = final_name(kill.temp)
        before = committed_files(listing(task.out), final)

        def trigger() -> bool:
            files = listing(task.out)  # one listing a poll: the temp's window is short
            if any(re.match(kill.temp, n) for n in own_temps(task.out, pid, files)):
                return True
            return bool(committed_files(files, final).items() - before.items())

    elif kill.entries:
        target = min(task.committed() + kill.entries, len(task.owned()))
        trigger = lambda: task.committed() >= target  # noqa: E731
    else:
        trigger = lambda: True  # noqa: E731
    if not wait_for(proc, trigger):
        return False
    timed_from_start = not graceful and kill.temp is None and not kill.entries
    since = start if timed_from_start else time.monotonic()
    time.sleep(max(0.0, since + kill.after_s - time.monotonic()))
    if not graceful:
        return send(proc, kill.sig)
    # A graceful stop is promised only inside Runner.run: while its stop handlers are installed
    # or it is writing a file (only Runner.run writes any). Frozen, the process cannot leave
    # it between this check and the signal, which it handles once it runs on.
    if not send(proc, signal.SIGSTOP):
        return False
    try:
        inside = stop_handlers_installed(pid) or bool(own_temps(task.out, pid))
        return inside and send(proc, kill.sig)
    finally:
        proc.send_signal(signal.SIGCONT)


def send(proc: subprocess.Popen, sig: signal.Signals) -> bool:
    if proc.poll() is not None:
        return False
    proc.send_signal(sig)
    return True


def run_once(task: Task, kill: Kill | None) -> dict:
    """Start one run, interrupt it as planned, wait for it; check what a single run promises."""
    proc = task.start()
    try:
        sent = interrupt(task, proc, kill) if kill is not None else False
        output = proc.communicate(timeout=RUN_TIMEOUT_S)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        raise AssertionError(f"run did not end in {RUN_TIMEOUT_S} s") from None
    finally:
        if proc.poll() is None:  # the test failed: leave no run behind
            proc.kill()
            proc.wait()
    rc = proc.returncode
    record = {"pid": proc.pid, "kill": kill if sent else None, "rc": rc}
    task.log.append(record)
    what = f"task {task.shard}, run {len(task.log)}, {record['kill']}: exit {rc}\n{output}"
    if not sent:
        assert rc == 0, what  # nothing interrupted it: it must finish the task
    elif kill.sig == signal.SIGKILL:
        assert rc in (0, -signal.SIGKILL), what  # 0: it ended as the signal was sent
    else:
        assert rc in (0, 75), what  # README: 75 interrupted, 0 only if every owned shard is done
        assert not own_temps(task.out, proc.pid), what  # a graceful stop leaves nothing partial
    if rc == 0:
        assert not task.uncommitted(), what
    return record


def run_until_done(task: Task, plan: list[Kill]) -> None:
    """Run once per planned kill (fewer if the task finishes first), then once more unless the
    last run finished the task: an uninterrupted run must (run_once checks its exit 0)."""
    for kill in plan:
        if not task.uncommitted() or run_once(task, kill)["rc"] == 0:
            break
    if not task.log or task.log[-1]["rc"] != 0:
        run_once(task, None)
