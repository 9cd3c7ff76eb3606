"""`pytest -m gpu` collects on a machine without polars (the GPU machine has none installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Found first on PYTHONPATH, this module makes `import polars` fail as a missing package does.
HIDE_POLARS = 'raise ModuleNotFoundError("No module named \'polars\'", name="polars")\n'


@pytest.mark.slow
def test_gpu_tests_collect_without_polars(tmp_path):
    (tmp_path / "polars.py").write_text(HIDE_POLARS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    hidden = subprocess.run([sys.executable, "-c", "import polars"], env=env, capture_output=True)
    assert b"ModuleNotFoundError" in hidden.stderr, hidden.stderr  # the hiding works
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*cmd, "tests"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    # Exit 0: collected, no collection error (an error interrupts the run with exit 2).
    assert result.returncode == 0, output
    assert "error" not in output.lower(), output
    # Modules that need polars themselves are skipped for its absence; no file holding GPU
    # tests may be among them: each one is collected.
    collected = {line.split("::")[0] for line in output.splitlines() if "::" in line}
    gpu_files = {
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if re.search(r"mark\.gpu\b", p.read_text())
    }
    assert gpu_files, "no GPU test found to collect"
    assert gpu_files <= collected, sorted(gpu_files - collected)
