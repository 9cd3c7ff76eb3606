"""TemplateProcess: renders chat templates in a worker process under hard limits.

A chat template is untrusted code. In-process checks can be bypassed (a loop that touches
nothing, a filter that builds gigabytes in one call, even while compiling), so templates run
in a separate process (template_worker.py) whose limits nothing inside it can lift:

- wall clock: each row must finish within `timeout_s` (plus KILL_GRACE_S); else the worker is
  killed (SIGKILL), that row fails as template_error, and a new worker renders the rest;
- memory: RLIMIT_AS caps the worker at its start size plus `memory_bytes`; a breach fails the
  row (MemoryError) or kills the worker (that row fails, a new worker goes on);
- stop: while waiting on the worker, `should_stop()` is polled every POLL_S; once it is true
  the worker is killed and RenderStopped raised, so a stop signal never waits on a render.

The cost for normal rows is small: one worker for the whole run, started on the first chat
row, with rows sent in batches of up to BATCH_BYTES and answered one line each.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

KILL_GRACE_S = 1.0  # past the worker's own deadline check, which gives the clearer message
STARTUP_S = 60.0  # an interpreter start on a loaded host; no template code runs before it
POLL_S = 0.05  # how often a wait on the worker checks should_stop()
BATCH_BYTES = 8 << 20  # rows (as JSON) sent to the worker at once, at least one row


@dataclass(frozen=True)
class TemplateLimits:
    """Hard limits on one chat-template render (and on compiling the template)."""

    timeout_s: float = 10.0  # wall clock per row
    memory_bytes: int = 1 << 30  # address space the worker may add to its size at start
    max_chars: int = 16 << 20  # characters one render may write


class Rendered(NamedTuple):
    """One row's result: the text, or why the template failed on it."""

    text: str | None
    error: str | None = None


class RenderStopped(Exception):
    """should_stop() turned true while rows were being rendered; none of them is done."""


class TemplateWorkerError(RuntimeError):
    """The worker could not be started at all (not a template's fault)."""


class _Died(Exception):
    """The worker ended or was killed; `reason` is the failed row's message."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


class TemplateProcess:
    """One chat template, rendered in a worker process.

    Args:
        source: the template's jinja2 source (untrusted).
        bos_token / eos_token: given to the template.
        limits: the hard limits.
        should_stop: polled while waiting; True makes render() raise RenderStopped.
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        limits: TemplateLimits | None = None,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.limits = limits or TemplateLimits()
        self.should_stop = should_stop or (lambda: False)
        self._config = {
            "template": source,
            "bos_token": bos_token,
            "eos_token": eos_token,
            "timeout_s": self.limits.timeout_s,
            "max_chars": self.limits.max_chars,
            "memory_bytes": self.limits.memory_bytes,
        }
        self.compile_error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._buf = bytearray()
        self.starts = 0  # workers started so far (one, unless rows broke some)

    # ----------------------------------------------------------------------------- public

    def render(self, conversations: list[list[dict[str, Any]]]) -> list[Rendered]:
        """Render each conversation; a row the template fails on gets its error, never raises
        for a template's fault (RenderStopped on a stop, TemplateWorkerError if no worker
        starts)."""
        # ASCII JSON: a lone surrogate in a row travels escaped (the worker fails that row)
        # instead of failing the encoding here.
        rows = [json.dumps(c).encode("ascii") for c in conversations]
        out: list[Rendered] = []
        while len(out) < len(rows):
            batch, size = [], 0
            for row in rows[len(out) :]:
                if batch and size + len(row) > BATCH_BYTES:
                    break
                batch.append(row)
                size += len(row) + 1
            out += self._render_batch(batch)
        return out

    def check(self) -> str | None:
        """Start the worker and compile the template now: None, or why it does not compile."""
        self._ensure_started()
        return self.compile_error

    def close(self) -> None:
        """End the worker (it is idle between calls: closing its stdin ends it at once)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        _kill(proc)

    # ---------------------------------------------------------------------------- workers

    def _ensure_started(self) -> None:
        if self._proc is not None or self.compile_error is not None:
            return
        env = dict(os.environ)
        # The directory holding the batchgen package (this file is batchgen/plan/*.py), so the
        # worker imports the same code even when batchgen runs from a checkout.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchgen.plan.template_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the run, not its worker
        )
        weakref.finalize(self, _kill, proc)
        self._proc, self._buf = proc, bytearray()
        self.starts += 1
        try:
            ready = self._exchange(b"", 1, STARTUP_S)
            if ready != [{"ready": True}]:
                raise _Died(f"unexpected first line {ready!r}")
        except _Died as e:
            self._stop_worker()
            raise TemplateWorkerError(f"the chat-template worker did not start: {e}") from None
        config = (json.dumps(self._config) + "\n").encode("ascii")
        try:
            (answer,) = self._exchange(config, 1, self.limits.timeout_s + KILL_GRACE_S)
        except _Died as e:
            self.compile_error = f"chat template does not compile: {e.reason}"
            self._stop_worker()
            return
        if "error" in answer:
            self.compile_error = str(answer["error"])
            self._stop_worker()

    def _stop_worker(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _kill(proc)

    def _render_batch(self, rows: list[bytes]) -> list[Rendered]:
        out: list[Rendered] = []
        while len(out) < len(rows):
            self._ensure_started()
            if self.compile_error is not None:
                return out + [Rendered(None, self.compile_error)] * (len(rows) - len(out))
            rest = rows[len(out) :]
            payload = b'{"rows": [' + b", ".join(rest) + b"]}\n"
            got: list[dict] = []
            try:
                self._exchange(payload, len(rest), self.limits.timeout_s + KILL_GRACE_S, got)
            except _Died as e:
                self._stop_worker()
                out += [_result(r) for r in got]
                out.append(Rendered(None, e.reason))  # the row the worker was on
                continue
            out += [_result(r) for r in got]
        return out

    def _exchange(
        self, payload: bytes, lines: int, timeout_s: float, got: list[dict] | None = None
    ) -> list[dict]:
        """Write `payload`, then read `lines` answers, each within `timeout_s` of the one
        before (the first: of the payload's last byte). Raises _Died (worker killed) on a
        timeout or the worker's end, RenderStopped (worker killed) on a stop."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        got = [] if got is None else got
        sel = selectors.DefaultSelector()
        out_fd, in_fd = proc.stdout.fileno(), proc.stdin.fileno()
        os.set_blocking(out_fd, False)
        os.set_blocking(in_fd, False)
        sel.register(out_fd, selectors.EVENT_READ)
        view, sent = memoryview(payload), 0
        if payload:
            sel.register(in_fd, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout_s if not payload else None
        try:
            while len(got) < lines:
                if self.should_stop():
                    self._stop_worker()
                    raise RenderStopped()
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    limit = f"{self.limits.timeout_s:g} s"
                    raise _Died(f"chat template took over {limit}; its worker was killed")
                wait = POLL_S if deadline is None else min(POLL_S, deadline - now)
                for key, _ in sel.select(max(wait, 0.0)):
                    if key.fd == in_fd:
                        try:
                            sent += os.write(in_fd, view[sent : sent + (1 << 20)])
                        except BrokenPipeError:
                            raise _Died(self._death_reason()) from None
                        if sent == len(payload):
                            sel.unregister(in_fd)
                            deadline = time.monotonic() + timeout_s
                        continue
                    chunk = os.read(out_fd, 1 << 20)
                    if not chunk:
                        raise _Died(self._death_reason())
                    self._buf += chunk
                    while (end := self._buf.find(b"\n")) >= 0 and len(got) < lines:
                        got.append(json.loads(self._buf[:end]))
                        del self._buf[: end + 1]
                        if deadline is not None:
                            deadline = time.monotonic() + timeout_s
        finally:
            sel.close()
        return got

    def _death_reason(self) -> str:
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:  # closed its output but lives on: end it
                _kill(self._proc)
                code = self._proc.returncode
        mib = self.limits.memory_bytes >> 20
        return (
            f"the chat-template worker died (exit {code}) on this row: the template exceeded "
            f"the memory limit ({mib} MiB) or crashed"
        )


def _result(answer: dict) -> Rendered:
    if "text" in answer:
        return Rendered(str(answer["text"]))
    return Rendered(None, str(answer.get("error", "chat template failed")))
