"""On two GPUs: 4-bit checkpoints under tensor parallel 2 (each rank's block of the packed
weights through the int4 kernels, the row-parallel partial sums written with `out` and
all-reduced inside CUDA graphs) equal tensor parallel 1 in fp32. The engines run in a child
process with a timeout, as in test_tensor_parallel_gpu.py, whose helpers this reuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
from int4_checkpoints import write_awq, write_compressed, write_gptq  # noqa: E402
from test_tensor_parallel_gpu import COMMON, assert_same, fp32_spec, reference, run_tp  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

WRITERS = {
    "gptq-g32-asym": lambda p, t: write_gptq(p, t, 32, False, False, "gptq"),
    "awq-g64": lambda p, t: write_awq(p, t, 64),
    "ct-channel": lambda p, t: write_compressed(p, t, -1, True),
}


@pytest.mark.parametrize("variant", list(WRITERS))
def test_tp2_int4_equals_tp1_fp32(tiny_model_dir, tmp_path, variant):
    path = WRITERS[variant](str(tmp_path / "model"), tiny_model_dir("llama"))
    spec = fp32_spec()
    # The heuristic tiles (no tuning: each row count's candidates would compile for minutes);
    # the tiles themselves are checked in tests/kernels/test_int4_gemm.py.
    options = dict(COMMON, dtype="float32", tune_gemms=False)
    want = reference(path, spec, **options)
    engine = {"path": path, "options": dict(options, tensor_parallel_size=2)}
    (got,), _ = run_tp(tmp_path, [engine], spec)
    assert got["graphs"]  # the int4 kernels and the all-reduces captured in decode graphs
    assert_same(got, want)
