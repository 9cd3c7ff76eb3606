"""Atomic file commits: write a temp file in the target directory, fsync, rename, fsync the dir."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket

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
