"""The exit codes of `batchgen run` / `validate`, and how a failure becomes one clear line.

    0   done (row errors are counted in the output, not fatal)
    1   some rows of this task ended as error records, and --strict was given
    2   bad job, model or input, usage error, or a permission error on a path
    70  internal error: one line on stderr, the full traceback written to a crash report
    74  I/O error: disk full, quota, failing device (committed shards are kept)
    75  stopped by SIGTERM / SIGUSR1 / SIGINT: run the same command again to resume
    130 a second SIGINT: stopped at once (committed shards are kept)

The numbers 70, 74 and 75 are sysexits.h's EX_SOFTWARE, EX_IOERR and EX_TEMPFAIL, which
schedulers already know (Slurm and HTCondor setups requeue on 75). A permission error is a
bad path the user must fix, so it is a 2, not a 74: running again cannot help.
"""

from __future__ import annotations

import datetime
import errno
import os
import platform
import sys
import tempfile
import traceback

from batchgen.cache_dir import user_cache_dir

EXIT_OK = 0
EXIT_ROW_ERRORS = 1
EXIT_BAD_JOB = 2
EX_SOFTWARE = 70
EX_IOERR = 74
EX_TEMPFAIL = 75
EXIT_ABORTED = 130

_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
CRASH_SUBDIR = "crash-reports"


def describe_os_error(e: OSError) -> tuple[int, str]:
    """(exit code, one-line message naming the path) for an OSError."""
    path = e.filename if e.filename is not None else "(path unknown)"
    why = e.strerror or str(e)
    if e.errno in _PERMISSION:
        return EXIT_BAD_JOB, (
            f"permission denied: {path} ({why}); give this user access to it, or choose "
            "another path"
        )
    if e.errno in _NO_SPACE:
        return EX_IOERR, (
            f"no space left writing {path} ({why}); committed shards are kept: free space, "
            "then run the same command again to resume"
        )
    return EX_IOERR, (
        f"I/O error on {path} ({why}); committed shards are kept: run the same command again "
        "to resume once the filesystem works"
    )


def write_crash_report(exc: BaseException) -> str | None:
    """Write the full traceback of `exc` (with the command line and versions) to a new file
    in the user cache directory's crash-reports/ (else the temp directory); its path, or None
    when neither can be written."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    text = "".join(
        [
            f"batchgen crash report, {stamp}\n",
            f"command: {' '.join(sys.argv)}\n",
            f"cwd: {os.getcwd()}\n",
            f"python {platform.python_version()} on {platform.platform()}\n\n",
            *traceback.format_exception(type(exc), exc, exc.__traceback__),
        ]
    )
    for folder in (os.path.join(user_cache_dir(), CRASH_SUBDIR), tempfile.gettempdir()):
        try:
            os.makedirs(folder, exist_ok=True)
            fd, path = tempfile.mkstemp(
                prefix=f"batchgen-{stamp}-{os.getpid()}-", suffix=".txt", dir=folder
            )
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


def describe_failure(exc: Exception) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that ended a command: OS errors by
    their errno, anything else an internal error with its traceback in a crash report."""
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    report = write_crash_report(exc)
    where = (
        f"the full traceback is in {report}"
        if report
        else "no crash report could be written (traceback follows)"
    )
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    message = (
        f"internal error ({type(exc).__name__}: {first}); {where}. Committed shards are kept; "
        "please report this with the crash report"
    )
    if report is None:
        message += "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return EX_SOFTWARE, message
