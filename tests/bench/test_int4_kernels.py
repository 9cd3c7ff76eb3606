"""The 4-bit kernel bench: its shapes and table on CPU; a short run on the GPU."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench import int4_kernels


def test_projection_shapes_of_the_presets():
    assert int4_kernels.projection_shapes("llama3.1-8b") == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    }  # fmt: skip
    assert int4_kernels.projection_shapes("llama3.1-70b")["gate_up"] == (57344, 8192)


def test_table_picks_the_fastest_fused_option():
    us = {"bf16 cuBLAS": 12.0, "bm16 x": 9.0, "bm1 y": 7.0, "dequant + cuBLAS": 30.0}
    row = {"m": 1, "n": 4096, "k": 4096, "int4_bytes": 4096 * 4096 // 2, "default": "bm16 x",
           "us": us}  # fmt: skip
    (line,) = int4_kernels.format_rows("o", [row], verbose=False)
    assert "fused       7.0 us" in line and "[bm1 y]" in line and "heuristic       9.0 us" in line


@pytest.mark.gpu
def test_int4_kernels_runs_on_the_gpu(tmp_path, capsys):
    int4_kernels.main(["--rows", "1,256", "--only", "o", "--reps", "3",
                       "--json", str(tmp_path / "k.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("\no ") + out.startswith("o ") >= 1 and "TB/s" in out
    assert torch.cuda.is_available()
