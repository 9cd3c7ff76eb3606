"""ops dispatch: CPU tensors run the references, CUDA tensors the kernels; the package imports
and runs without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import batchgen.kernels as K
import pytest
import torch
from batchgen.kernels.decode_attention import paged_attention_decode_ref
from batchgen.kernels.logprobs import token_logprobs_ref
from batchgen.kernels.paged_attention import paged_attention_ref, varlen_attention_ref
from batchgen.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from batchgen.kernels.rotary import rotary_embedding_ref
from batchgen.kernels.sampling import gumbel_argmax_ref

# Runs every op once on small float32 CPU tensors; used in-process and without Triton.
SMOKE = textwrap.dedent(
    """
    import torch
    import batchgen.kernels as K

    def run_all(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 32, generator=g).to(device)
        w = torch.rand(32, generator=g).to(device)
        out = {"rms_norm": K.rms_norm(x, w, 1e-6)}
        out["rms_norm_3d"] = K.rms_norm(x.view(4, 2, 16), w[:16], 1e-6)
        out["fused_add_rms_norm"] = K.fused_add_rms_norm(x, x.flip(0), w, 1e-6)
        cache = K.build_cos_sin_cache(16, 64, 10000.0, None).to(device)
        pos = torch.tensor([0, 5, 9, 63], device=device)
        q = torch.randn(4, 4, 16, generator=g).to(device)
        k = torch.randn(4, 2, 16, generator=g).to(device)
        v = torch.randn(4, 2, 16, generator=g).to(device)
        out["rotary_embedding"] = K.rotary_embedding(pos, q, k, cache)
        out["silu_and_mul"] = K.silu_and_mul(x)
        k_cache = torch.zeros(4, 8, 2, 16, device=device)
        v_cache = torch.zeros_like(k_cache)
        K.store_kvcache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, -1], device=device))
        cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
        K.store_kvcache(k[3:], v[3:], k_cache, v_cache, torch.tensor([17], device=device))
        out["k_cache"] = k_cache
        out["paged_attention"] = K.paged_attention(
            q, k_cache, v_cache, cu, seq_lens, tables, 0.25, 3
        )
        out["varlen_attention"] = K.varlen_attention(q, k, v, cu, 3, 0.25)
        out["paged_attention_decode"] = K.paged_attention_decode(
            q[:2], k_cache, v_cache, seq_lens, tables, 0.25
        )
        logits = torch.randn(3, 50, generator=g).to(device)
        out["sample_gumbel"] = K.sample_gumbel(
            logits, torch.tensor([1, 2, 3], device=device), torch.tensor([0, 0, 9], device=device)
        )
        out["token_logprobs"] = K.token_logprobs(logits, torch.tensor([0, 7, 49], device=device))
        return out
    """
)


def _run_all(device):
    scope: dict = {}
    exec(SMOKE, scope)
    return scope["run_all"](device)


def test_cpu_ops_are_the_references():
    out = _run_all("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    w = torch.rand(32, generator=g)
    assert torch.equal(out["rms_norm"], rms_norm_ref(x, w, 1e-6))
    assert torch.equal(out["rms_norm_3d"], rms_norm_ref(x.view(4, 2, 16), w[:16], 1e-6))
    for a, b in zip(out["fused_add_rms_norm"], fused_add_rms_norm_ref(x, x.flip(0), w, 1e-6)):
        assert torch.equal(a, b)
    q = torch.randn(4, 4, 16, generator=g)
    k = torch.randn(4, 2, 16, generator=g)
    v = torch.randn(4, 2, 16, generator=g)
    cache = K.build_cos_sin_cache(16, 64, 10000.0, None)
    pos = torch.tensor([0, 5, 9, 63])
    for a, b in zip(out["rotary_embedding"], rotary_embedding_ref(pos, q, k, cache)):
        assert torch.equal(a, b)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    seq_lens = torch.tensor([3, 2], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    k_cache = out["k_cache"]
    assert torch.equal(k_cache[0, :3], k[:3]) and torch.equal(k_cache[2, 1], k[3])
    v_cache = torch.zeros_like(k_cache)
    v_cache[0, :3], v_cache[2, 1] = v[:3], v[3]
    expected = paged_attention_ref(q, k_cache, v_cache, cu, seq_lens, tables, 0.25, 3)
    assert torch.equal(out["paged_attention"], expected)
    assert torch.equal(out["varlen_attention"], varlen_attention_ref(q, k, v, cu, 3, 0.25))
    expected = paged_attention_decode_ref(q[:2], k_cache, v_cache, seq_lens, tables, 0.25)
    assert torch.equal(out["paged_attention_decode"], expected)
    logits = torch.randn(3, 50, generator=g)
    expected = gumbel_argmax_ref(logits, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 9]))
    assert torch.equal(out["sample_gumbel"], expected)
    expected = token_logprobs_ref(logits, torch.tensor([0, 7, 49]))
    assert torch.equal(out["token_logprobs"], expected)
    assert not K.use_triton(x)


def test_ops_import_and_run_without_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # makes `import triton` raise ImportError\n"
        + SMOKE
        + textwrap.dedent(
            """
            from batchgen.kernels.launch import HAS_TRITON
            from batchgen.kernels.rms_norm import rms_norm
            assert not HAS_TRITON
            run_all("cpu")
            try:
                rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
            except RuntimeError as e:
                assert "Triton is not installed" in str(e)
            else:
                raise AssertionError("launcher ran without Triton")
            print("ok")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.gpu
def test_cuda_ops_match_cpu_references():
    gpu = _run_all("cuda")
    cpu = _run_all("cpu")
    for name, expected in cpu.items():
        got = gpu[name]
        pairs = zip(got, expected) if isinstance(expected, tuple) else [(got, expected)]
        for a, b in pairs:
            torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4, msg=name)
    assert K.use_triton(torch.zeros(1, device="cuda"))


def test_programmatic_dependent_launch_only_on_cuda(monkeypatch):
    """PDL is asked for only on a CUDA device, never under the interpreter, and not at all
    with launch.PDL = 0 (the GPU test checks that it changes no token where it is on)."""
    from batchgen.kernels import launch

    assert not launch.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(launch, "_has_pdl", lambda device: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.use_pdl(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch.use_pdl(torch.device("cuda", 0)) == (launch.gdc_wait is not None)
    monkeypatch.setattr(launch, "PDL", 0)
    assert not launch.use_pdl(torch.device("cuda", 0))
