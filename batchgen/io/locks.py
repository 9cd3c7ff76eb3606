"""Lock files in `<output>/_locks/`: who works on a shard (or plans, or runs), on any host.

A lock is a file created only if absent (its content written first, then published with
link(), so it is never seen half-written) holding its holder's host, boot id, pid, process
start time and a random token. The holder keeps an `fcntl` lock on it and renews its lease by
touching it (its mtime). A lock is live while its lease is current and, for a holder on this
host, while that very process (pid and start time) runs; where fcntl locks reach across hosts
a released fcntl lock also shows a dead holder elsewhere. A stale lock is broken by renaming
it aside, which only one breaker can do, and checking that it was the stale one.

A data parallel worker's locks name its parent as their owner (`set_owner`): they stay live
while the parent runs, even after the worker died, until the parent breaks them (the shard goes
to another worker) or takes them over (`take_over`: the shard is set aside).

Locks keep two live runs off the same shard; they are not what keeps output exactly once:
every commit is published with link() (atomic.publish), so even a holder paused past its lease
cannot commit a second copy of a shard.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from batchgen.io import atomic

LOCK_DIR = "_locks"
DEFAULT_LEASE_S = 120.0  # a holder that has not renewed for this long is presumed gone
_UNREADABLE_GRACE_S = 10.0  # a lock file that cannot be parsed this long after its mtime is stale


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


HOST = socket.gethostname()
BOOT_ID = _boot_id()
# (st_dev, st_ino) -> holder of the locks this process holds. Closing any descriptor of a file
# drops this process's fcntl lock on it, so their files are never opened to be inspected.
_HELD: dict[tuple[int, int], dict] = {}
# The process whose life keeps this process's locks live, when not this one (set_owner).
_OWNER: dict = {}


def process_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` of this host runs and is the one that started at `start`."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    now = process_start(pid)
    return start is None or now is None or now == start


@dataclass(frozen=True)
class LockInfo:
    """A lock file's content and state, as another process sees it."""

    path: str
    holder: dict  # host, boot_id, pid, start, token, since, what, task
    mtime: float
    live: bool

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def who(self) -> str:
        h = self.holder
        task = f", task {h['task']}" if h.get("task") else ""
        return f"{h.get('host', '?')} pid {h.get('pid', '?')}{task}"


def _same_host(holder: dict) -> bool:
    return holder.get("host") == HOST and holder.get("boot_id", "") == BOOT_ID


def _fcntl_free(path: str) -> bool:
    """True if no process holds an fcntl lock on `path` (the holder's is gone), False if one
    does or the filesystem cannot tell."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the probe's own lock


def inspect(path: str, lease_s: float, now: float | None = None) -> LockInfo | None:
    """The lock at `path` and whether it is live; None if there is none."""
    now = time.time() if now is None else now
    try:
        st = os.stat(path)
        mtime = st.st_mtime
        if (st.st_dev, st.st_ino) in _HELD:
            return LockInfo(path, _HELD[(st.st_dev, st.st_ino)], mtime, live=True)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a planted symlink is not followed
        with open(fd, encoding="utf-8") as f:
            holder = json.load(f)
        if not isinstance(holder, dict):
            raise ValueError
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return LockInfo(path, {}, 0.0, live=False) if _old(path, now) else None
    if now - mtime > lease_s:
        live = False  # lease expired: the holder is gone, hung or paused
    elif _same_host(holder) and "owner" in holder:
        live = process_alive(int(holder["owner"]), holder.get("owner_start"))
    elif _same_host(holder):
        live = process_alive(int(holder.get("pid", 0)), holder.get("start"))
    else:
        live = not (holder.get("fcntl") and _fcntl_free(path))
    return LockInfo(path, holder, mtime, live)


def _old(path: str, now: float) -> bool:
    try:
        return now - os.stat(path).st_mtime > _UNREADABLE_GRACE_S
    except OSError:
        return False


class HeldLock:
    """A lock this process holds: its open file (fcntl lock, lease renewal) and its path."""

    def __init__(self, path: str, fd: int, holder: dict):
        self.path, self.fd, self.holder = path, fd, holder
        st = os.fstat(fd)
        self._key = (st.st_dev, st.st_ino)
        _HELD[self._key] = holder

    def renew(self) -> None:
        os.utime(self.fd)  # the inode we created, even if the name now points elsewhere

    def still_ours(self) -> bool:
        try:
            st, mine = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.still_ours():
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            _HELD.pop(self._key, None)
            os.close(self.fd)
            self.fd = -1


def set_owner(pid: int) -> None:
    """Locks this process takes from now on are live while process `pid` (this host's) runs
    and their lease is renewed, whether or not this process still runs."""
    _OWNER.update(owner=pid, owner_start=process_start(pid))


def holder_record(what: str, task: str = "") -> dict:
    pid = os.getpid()
    return {
        "host": HOST,
        "boot_id": BOOT_ID,
        "pid": pid,
        "start": process_start(pid),
        "token": secrets.token_hex(8),
        "since": time.time(),
        "what": what,
        "task": task,
        **_OWNER,
    }


def try_acquire(
    path: str, what: str, lease_s: float = DEFAULT_LEASE_S, task: str = ""
) -> HeldLock | LockInfo:
    """Take the lock at `path`: a HeldLock, or the LockInfo of the live holder in the way.
    A stale lock in the way is broken first."""
    for _ in range(50):
        holder = holder_record(what, task)
        held = _create(path, holder)
        if held is not None:
            return held
        info = inspect(path, lease_s)
        if info is None:
            continue  # released meanwhile: try again
        if info.live:
            return info
        if not break_stale(info):
            time.sleep(0.01)  # another process is breaking it: look again shortly
    info = inspect(path, lease_s)
    if info is not None and info.live:
        return info
    raise OSError(errno.EAGAIN, "could not take the lock (contended)", path)


def _create(path: str, holder: dict, replace: bool = False) -> HeldLock | None:
    """Publish a lock file at `path` holding `holder`: with link() (None if one exists), or
    with replace, renamed over whatever is there."""
    atomic.own_dir(os.path.dirname(path))
    tmp = atomic.temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder["fcntl"] = True
        except OSError:
            holder["fcntl"] = False  # no fcntl locks here: leases and pids decide
        os.write(fd, json.dumps(holder).encode())
        try:
            (os.replace if replace else os.link)(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return HeldLock(path, fd, holder)


def take_over(info: LockInfo, what: str, task: str = "") -> HeldLock:
    """Replace the lock `info` saw, which this process owns (a dead worker's, see set_owner),
    with one it holds itself, in one rename: no other process can take the name between."""
    held = _create(info.path, holder_record(what, task), replace=True)
    assert held is not None  # a rename never finds the name taken
    return held


# A breaker's guard older than this was left by a breaker that died mid-break: removed.
_GUARD_STALE_S = 30.0


def break_stale(info: LockInfo) -> bool:
    """Remove the stale lock `info` saw; False if another process is breaking it right now
    (the caller retries). Breakers take a guard file (`<lock>.breaking`, O_EXCL) and, under
    it, remove the lock only if it is still the one `info` saw (same holder token, or the
    same mtime for an unreadable one). While the stale lock holds the name no new lock can be
    created, so no breaker ever removes a lock taken after `info` was read."""
    guard = f"{info.path}.breaking"
    try:
        os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - os.stat(guard).st_mtime > _GUARD_STALE_S:
                os.unlink(guard)
        return False
    try:
        now = inspect(info.path, float("inf"))
        if now is None:
            return True  # gone already
        same = (
            now.holder.get("token") == info.holder.get("token")
            if info.holder
            else not now.holder and now.mtime == info.mtime
        )
        if same:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(info.path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(guard)


def list_locks(out_dir: str, lease_s: float = DEFAULT_LEASE_S) -> list[LockInfo]:
    """Every lock file of an output directory, live or stale, by name."""
    d = os.path.join(out_dir, LOCK_DIR)
    found = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) and not os.path.islink(d) else []:
        if name.endswith(".lock") and not name.startswith("."):
            info = inspect(os.path.join(d, name), lease_s)
            if info is not None:
                found.append(info)
    return found


def tidy(out_dir: str, lease_s: float = DEFAULT_LEASE_S) -> None:
    """Break the stale locks of an output directory (holders gone), and remove `_locks/`
    itself if that leaves it empty."""
    for info in list_locks(out_dir, lease_s):
        if not info.live:
            break_stale(info)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(out_dir, LOCK_DIR))


def lock_path(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, LOCK_DIR, name)


class LeaseKeeper:
    """A daemon thread renewing the leases of the locks this process holds (every quarter
    lease), so a long engine step or model load never lets a live holder's lease lapse."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S):
        self.lease_s = lease_s
        self.interval = max(0.5, lease_s / 4)
        self._held: dict[str, HeldLock] = {}
        self._guard = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchgen-leases", daemon=True)
        self._thread.start()

    def add(self, lock: HeldLock) -> None:
        with self._guard:
            self._held[lock.path] = lock

    def release(self, lock: HeldLock) -> None:
        with self._guard:
            self._held.pop(lock.path, None)
            lock.release()

    def forget(self, lock: HeldLock) -> None:
        """Stop renewing `lock` and leave its file to its owner (set_owner's process)."""
        with self._guard:
            self._held.pop(lock.path, None)

    def held(self) -> Iterator[HeldLock]:
        with self._guard:
            return iter(list(self._held.values()))

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            with self._guard:
                for lock in list(self._held.values()):
                    with contextlib.suppress(OSError):
                        lock.renew()

    def close(self) -> None:
        self._done.set()
        with self._guard:
            for lock in self._held.values():
                with contextlib.suppress(OSError):
                    lock.release()
            self._held.clear()
