"""kernels/ ships as batchgen.kernels and never shadows Hugging Face's top-level `kernels`."""

from __future__ import annotations

import subprocess
import sys


def test_no_top_level_kernels_and_transformers_imports(tmp_path):
    # A fresh interpreter outside the checkout sees only what is installed.
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('kernels') is None, importlib.util.find_spec('kernels')\n"
        "import batchgen.kernels.ops\n"
        "assert importlib.util.find_spec('kernels') is None\n"
        "import transformers\n"
        "from transformers import AutoModelForCausalLM\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
