"""Atomic file commits: write a temp file in the target directory, fsync, then rename it into
place (shared files any task may rewrite) or publish it with link(), which never replaces an
existing file (shards, entries, claims: the first commit wins)."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import socket
from typing import NoReturn

from batchgen.job.spec import JobError

TMP_MARK = ".tmp-"
# Six hex digits naming this host, the first part of a temp name's hex: a later run on the
# same host can then tell a dead writer's leftover (its pid is gone) from a write in progress.
HOST_TAG = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def temp_path(final: str) -> str:
    """A unique temp name next to `final` (same filesystem, so the rename is atomic):
    "." + name + ".tmp-<pid>-<host tag><6 random hex>"."""
    head, name = os.path.split(final)
    token = HOST_TAG + secrets.token_hex(3)
    return os.path.join(head, f".{name}{TMP_MARK}{os.getpid()}-{token}")


def writer_is_gone(pid: int, token: str) -> bool:
    """Whether the process that named a temp file (its pid and hex token) has certainly ended:
    it ran on this host (the token starts with HOST_TAG) and no process has that pid now. A
    pid reused since then only makes this answer False, never wrongly True."""
    if not token.startswith(HOST_TAG) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by someone else
    return False


def link_refused(shown: str) -> JobError:
    """The error for symlinks planted where batchgen reads or writes (`shown`: their paths)."""
    return JobError(
        f"output.path: {shown} is a symlink, which batchgen never creates and does not "
        "follow inside its output directory; remove it (the file it points to is not "
        "touched)"
    )


def own_dir(path: str) -> str:
    """Create directory `path` if absent and return it; a symlink there (planted since the
    run's start) is refused, never written through."""
    os.makedirs(path, exist_ok=True)
    if os.path.islink(path):
        raise link_refused(path)
    return path


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, final: str) -> None:
    """fsync `tmp`, rename it over `final`, then fsync the directory so the rename is durable."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")


def write_bytes(final: str, data: bytes) -> None:
    """Atomically replace `final` with `data`. An OSError names the file (see named)."""
    tmp = temp_path(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        commit(tmp, final)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise named(e, final) from e
        raise


def named(e: OSError, path: str) -> OSError:
    """`e` if it names a file, else the same error naming `path`: a failed write() or fsync
    (a full disk) names none, and the message a user sees must say where."""
    if e.filename is not None:
        return e
    return OSError(e.errno, e.strerror or str(e), path)  # the errno's subclass, e.g. ENOSPC


def _raise_named(e: OSError, path: str) -> NoReturn:
    """Raise `e`, naming `path` if it names no file (see named)."""
    better = named(e, path)
    if better is e:
        raise e
    raise better from e


class LostTemp(OSError):
    """A commit's own temp file vanished before it was published (a run that took the shard
    over removed it as debris): the commit did not happen; nothing was overwritten."""


# link() refused by a filesystem without hard links: publish by rename after a check instead.
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK}


def publish(tmp: str, final: str) -> bool:
    """fsync `tmp` and give it the name `final` unless that name exists: True if published,
    False if `final` already existed (`tmp` is removed either way). The name is taken with
    link(), which fails on an existing name, so of two processes publishing the same file
    exactly one wins and nothing committed is ever replaced."""
    try:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            if os.path.exists(final):
                return False
            os.rename(tmp, final)
        fsync_dir(os.path.dirname(final) or ".")
        return True
    except FileNotFoundError as e:
        if not os.path.exists(tmp):
            raise LostTemp(errno.ENOENT, "temp file removed before publishing", tmp) from e
        _raise_named(e, final)
    except OSError as e:
        _raise_named(e, final)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def publish_bytes(final: str, data: bytes) -> bool:
    """Create `final` holding `data` unless it exists (see publish). The data is in memory, so
    a temp removed as debris by a run that took the shard over is written once more: that run
    removes a shard's temps once, when it takes the lock."""
    for attempt in (1, 2):
        tmp = temp_path(final)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except BaseException as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(e, OSError):
                _raise_named(e, final)
            raise
        try:
            return publish(tmp, final)
        except LostTemp:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
