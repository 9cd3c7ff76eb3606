"""The chat-template worker process: renders conversations under a memory limit, one JSON line each.

Started by template_process.TemplateProcess as `python -m batchgen.plan.template_worker`; never
imports torch. Its parent enforces the wall-clock limit (it kills the worker); the worker
enforces the memory limit on itself (RLIMIT_AS: its address space at start plus the limit), so
a template that builds a huge value gets a MemoryError, or dies, instead of exhausting the host.
It ignores the stop signals (the parent decides when a run stops, and a terminal's Ctrl-C or a
scheduler's SIGTERM to every process must not fail a row), and exits when its stdin closes or
its parent dies.

Protocol, one JSON object per line (UTF-8), each direction in turn:
  worker -> {"ready": true}                      once imported
  parent -> {"template", "bos_token", "eos_token", "timeout_s", "max_chars", "memory_bytes"}
  worker -> {"ok": true} | {"error": message}     the template compiled, or why not
  parent -> {"rows": [messages, ...]}            any number of times
  worker -> {"text": str} | {"error": message}   one line per row, in order, as each finishes
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time

from batchgen.plan.sandbox import TemplateFailure, compile_chat_template, render_chat

PARENT_POLL_S = 0.5


def _address_space() -> int:
    """This process's virtual memory size in bytes now (Linux /proc), or 0 if unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def limit_memory(extra_bytes: int) -> None:
    """Cap this process's address space at its size now plus `extra_bytes` (RLIMIT_AS)."""
    base = _address_space()
    if base:
        cap = base + extra_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _exit_with_parent(parent: int) -> None:
    # A parent killed with SIGKILL cannot kill its worker; the worker notices and leaves, even
    # in the middle of a render that never ends.
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def _send(out, obj: dict) -> None:
    try:
        line = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # an error message quoting a lone surrogate: escape it
        line = json.dumps(obj).encode("ascii")
    out.write(line + b"\n")
    out.flush()


def _render_row(template, messages, bos: str, eos: str) -> dict:
    try:
        if not isinstance(messages, list):
            raise TemplateFailure("messages must be a list")
        return {"text": render_chat(template, messages, bos, eos)}
    except TemplateFailure as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "chat template exceeded the template worker's memory limit"}
    except Exception as e:  # anything else is this row's failure, not the worker's
        return {"error": f"chat template failed: {e!r}"}


def main() -> int:
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a breach must not dump a gigabyte
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    _send(out, {"ready": True})
    line = inp.readline()
    if not line:
        return 0
    config = json.loads(line)
    limit_memory(int(config["memory_bytes"]))
    bos, eos = config["bos_token"], config["eos_token"]
    try:
        template = compile_chat_template(
            config["template"], float(config["timeout_s"]), int(config["max_chars"])
        )
    except TemplateFailure as e:
        _send(out, {"error": str(e)})
        return 0
    except MemoryError:
        _send(out, {"error": "chat template exceeded the memory limit while compiling"})
        return 0
    _send(out, {"ok": True})
    while line := inp.readline():
        for messages in json.loads(line)["rows"]:
            _send(out, _render_row(template, messages, bos, eos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
