"""The user's batchgen cache directory: GEMM tunings, file digests and crash reports live here."""

from __future__ import annotations

import os


def user_cache_dir() -> str:
    """$BATCHGEN_CACHE_DIR, else $XDG_CACHE_HOME/batchgen, else ~/.cache/batchgen (an empty
    variable counts as unset). Not created here: each user of it creates what it writes."""
    root = os.environ.get("BATCHGEN_CACHE_DIR")
    if root:
        return root
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "batchgen")
