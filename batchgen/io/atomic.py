"""Atomic file commits: write a temp file in the target directory, fsync, rename, fsync the dir."""

from __future__ import annotations

import os
import secrets

TMP_MARK = ".tmp-"


def temp_path(final: str) -> str:
    """A unique temp name next to `final` (same filesystem, so the rename is atomic)."""
    head, name = os.path.split(final)
    return os.path.join(head, f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


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
    """Atomically replace `final` with `data`."""
    tmp = temp_path(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        commit(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
