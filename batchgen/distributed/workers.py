"""The processes of ranks 1..N-1 and their control connections to rank 0.

Rank 0 (the engine's own process) starts each worker as `python -m <module>` (a fresh
interpreter: nothing of the caller's __main__ is re-run) and talks to it over an authenticated
Unix-socket connection (multiprocessing.connection): start-up agreements (`agree`), one step
description per engine step (`send_step`), and `stop`. Tensors never travel this way; the
collectives of the process group carry them.

Failure handling:
- a worker that raises reports the error over its connection and exits; rank 0 raises it;
- a worker that dies is seen by rank 0's monitor thread within MONITOR_INTERVAL_S: it records
  the failure, prints it at once, and calls `on_failure` (the engine aborts the NCCL
  communicators, so a step waiting on the dead rank returns); the engine's next call raises
  TensorParallelError naming the rank, its pid and exit status;
- rank 0 gone (even killed): each worker's parent watcher ends the worker.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from batchgen.distributed.group import TensorParallelError

MONITOR_INTERVAL_S = 0.5
START_TIMEOUT_S = 300.0  # from spawn to the worker's hello (a cold `import torch` included)
STOP_TIMEOUT_S = 30.0
_ENV_ADDRESS = "BATCHGEN_TP_ADDRESS"
_ENV_AUTHKEY = "BATCHGEN_TP_AUTHKEY"
_ENV_RANK = "BATCHGEN_TP_RANK"


class WorkerError(TensorParallelError):
    """A worker raised: `kind` is its exception's class name, `detail` its message."""

    def __init__(self, rank: int, kind: str, detail: str) -> None:
        super().__init__(f"tensor parallel rank {rank}: {kind}: {detail}")
        self.rank, self.kind, self.detail = rank, kind, detail


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class WorkerPool:
    """Rank 0's handle on the worker processes (ranks 1 .. size - 1)."""

    def __init__(self, procs: dict[int, subprocess.Popen], conns: dict[int, Connection]):
        self.procs = procs
        self.conns = conns
        self.failure: str | None = None
        self.failed_rank: int | None = None
        self.on_failure: Callable[[], None] | None = None
        self._closing = False
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(
        cls, size: int, module: str, setup: Callable[[int], Any], timeout_s: float = START_TIMEOUT_S
    ) -> WorkerPool:
        """Start ranks 1 .. size - 1 as `python -m module`, wait for each to connect, and send
        rank r the object setup(r).

        Raises:
            TensorParallelError: a worker exited or did not connect within timeout_s.
        """
        authkey = os.urandom(32)
        listener = Listener(family="AF_UNIX", authkey=authkey)
        env = dict(os.environ)
        # The workers import batchgen exactly as this process does.
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        env[_ENV_ADDRESS] = listener.address
        env[_ENV_AUTHKEY] = authkey.hex()
        procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, size):
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", module], env={**env, _ENV_RANK: str(rank)}
            )
        accepted: list[Connection] = []
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(accepted) < size - 1:
                    accepted.append(listener.accept())
            except BaseException as e:  # the listener closed under it, or a bad handshake
                errors.append(e)

        acceptor = threading.Thread(target=accept, name="tp-accept", daemon=True)
        acceptor.start()
        deadline = time.monotonic() + timeout_s
        try:
            while acceptor.is_alive():
                acceptor.join(MONITOR_INTERVAL_S)
                dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
                if dead:
                    rank, code = next(iter(dead.items()))
                    raise TensorParallelError(
                        f"tensor parallel rank {rank} exited while starting ({_exit_text(code)}); "
                        "its error is printed above"
                    )
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor parallel workers did not connect within {timeout_s:.0f} s"
                    )
            if errors:
                raise TensorParallelError(f"tensor parallel workers could not connect: {errors[0]}")
            conns = {}
            for conn in accepted:
                kind, rank = conn.recv()
                conns[rank] = conn
            for rank, conn in conns.items():
                conn.send(setup(rank))
        except BaseException:
            listener.close()
            _kill(procs.values())
            raise
        listener.close()
        return cls(procs, conns)

    # ---- messages -------------------------------------------------------------------------
    def agree(self, phase: str, value: Any, reduce: Callable[[list], Any]) -> Any:
        """Collect each worker's value for `phase` (worker side: Rank0Link.agree), combine
        [rank 0's, rank 1's, ...] with `reduce`, send the result to every worker, return it.

        Raises:
            WorkerError: a worker reported an error instead (it exits after reporting).
            TensorParallelError: a worker died.
        """
        values = [value]
        for rank in sorted(self.conns):
            msg = self._recv(rank)
            if msg[0] == "error":
                raise WorkerError(rank, msg[1], msg[2])
            if msg[:2] != ("agree", phase):
                raise TensorParallelError(
                    f"tensor parallel rank {rank} is out of step: sent {msg[:2]} during {phase!r}"
                )
            values.append(msg[2])
        result = reduce(values)
        self._send_all(pickle.dumps(("agreed", phase, result), protocol=5))
        return result

    def send_step(self, payload: Any) -> None:
        """Send one step's description to every worker (pickled once)."""
        self._send_all(pickle.dumps(("step", payload), protocol=5))

    def _send_all(self, data: bytes) -> None:
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(data)
            except OSError as e:
                self.check()
                message = f"tensor parallel rank {rank}: connection lost ({e})"
                raise TensorParallelError(message) from e

    def _recv(self, rank: int):
        """The next message from `rank`, watching for its death while waiting."""
        conn = self.conns[rank]
        while not wait([conn], timeout=MONITOR_INTERVAL_S):
            self.check()
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            self._poll(wait_s=2.0)
            self.check()
            raise TensorParallelError(f"tensor parallel rank {rank}: connection lost ({e})") from e

    # ---- health ----------------------------------------------------------------------------
    def _poll(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None and self.failure is None and not self._closing:
                    self.failed_rank = rank
                    self.failure = (
                        f"tensor parallel rank {rank} (pid {proc.pid}) died ({_exit_text(code)}); "
                        "the engine cannot continue"
                    )
            if self.failure is not None or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def check(self) -> None:
        """Raise TensorParallelError if a worker has died (with the error it reported, if it
        raised one before exiting). Called from the engine's thread only."""
        self._poll()
        if self.failure is not None:
            raise TensorParallelError(self.failure + self._last_words())

    def raise_if_died(self, error: BaseException, wait_s: float = 2.0) -> None:
        """After `error` from a collective or a send: raise TensorParallelError naming the dead
        worker if one died (waiting up to wait_s for its exit to show), else return."""
        self._poll(wait_s)
        if self.failure is not None:
            raise TensorParallelError(self.failure + self._last_words()) from error

    def _last_words(self) -> str:
        """The error the failed worker sent before exiting, as text to append ('' if none)."""
        conn = self.conns.get(self.failed_rank)
        try:
            while conn is not None and conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    return f"; it reported {msg[1]}: {msg[2]}"
        except (EOFError, OSError):
            pass
        return ""

    def _watch(self) -> None:
        while not self._closing:
            self._poll()
            if self.failure is not None:
                print(f"batchgen: {self.failure}", file=sys.stderr, flush=True)
                if self.on_failure is not None:
                    try:
                        self.on_failure()
                    except Exception as e:  # noqa: BLE001 - reporting is all that is left
                        print(f"batchgen: aborting the process group failed: {e}", file=sys.stderr)
                return
            time.sleep(MONITOR_INTERVAL_S)

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask every worker to stop, wait up to timeout_s for all, kill the rest."""
        self._closing = True
        stop = pickle.dumps(("stop",), protocol=5)
        for conn in self.conns.values():
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(self.procs.values())
        for conn in self.conns.values():
            conn.close()
        if self._monitor is not threading.current_thread():
            self._monitor.join(timeout=2 * MONITOR_INTERVAL_S)


def _kill(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


class Rank0Link:
    """A worker's connection to rank 0 (see WorkerPool)."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank = rank
        self.conn = conn

    @classmethod
    def connect(cls) -> tuple[Rank0Link, Any]:
        """Connect to the rank 0 that started this process; returns the link and the setup
        object rank 0 sent."""
        rank = int(os.environ[_ENV_RANK])
        conn = Client(
            os.environ[_ENV_ADDRESS],
            family="AF_UNIX",
            authkey=bytes.fromhex(os.environ[_ENV_AUTHKEY]),
        )
        conn.send(("hello", rank))
        _watch_parent()
        return cls(rank, conn), conn.recv()

    def agree(self, phase: str, value: Any, reduce: Callable[[list], Any] | None = None) -> Any:
        """Send this rank's value for `phase`; return the value rank 0 settled on. (`reduce`
        is rank 0's business; accepted so both sides read alike.)"""
        self.conn.send(("agree", phase, value))
        msg = self._recv()
        if msg[:2] != ("agreed", phase):
            raise TensorParallelError(f"rank {self.rank}: expected the {phase!r} result, got {msg}")
        return msg[2]

    def report(self, error: BaseException) -> None:
        """Tell rank 0 why this worker is about to exit (best effort)."""
        try:
            self.conn.send(("error", type(error).__name__, str(error)))
        except OSError:
            pass

    def _recv(self):
        msg = pickle.loads(self.conn.recv_bytes())
        if msg[0] == "stop":
            raise SystemExit(0)
        return msg

    def serve(self, step: Callable[[Any], None]) -> None:
        """Run step(payload) for each step rank 0 sends, until it sends stop (or is gone)."""
        while True:
            try:
                msg = self._recv()
            except (EOFError, OSError):
                return  # rank 0 closed the connection: nothing more will come
            except SystemExit:
                return
            if msg[0] != "step":
                raise TensorParallelError(f"rank {self.rank}: unexpected message {msg[0]!r}")
            step(msg[1])


def _watch_parent() -> None:
    """End this worker if rank 0 (its parent) goes away, wherever the worker is blocked."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent", daemon=True).start()
