"""token_logprobs: kernel vs reference, reference vs the log-sum-exp formula."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.launch import KERNEL_DTYPES
from batchgen.kernels.logprobs import token_logprobs, token_logprobs_ref

DTYPES = list(KERNEL_DTYPES)  # every dtype the kernels are built for


def _case(n, vocab, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return logits.to(device), targets.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, vocab", [(1, 7), (5, 1000), (3, 9000)])
def test_token_logprobs_matches_ref(device, n, vocab, dtype):
    logits, targets = _case(n, vocab, dtype, device)
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32 and out.shape == (n,)
    # Both compute in fp32 from the same inputs: only summation order differs.
    torch.testing.assert_close(out, token_logprobs_ref(logits, targets), atol=1e-4, rtol=1e-5)


def test_token_logprobs_with_masked_entries(device):
    logits, targets = _case(4, 5000, torch.float32, device)
    logits[:, ::2] = float("-inf")
    logits[0, :4097] = float("-inf")  # a whole first tile masked in row 0
    targets = targets | 1  # odd ids stay finite
    torch.testing.assert_close(
        token_logprobs(logits, targets), token_logprobs_ref(logits, targets), atol=1e-4, rtol=1e-5
    )


def test_token_logprobs_strided_rows(device):
    logits, targets = _case(3, 300, torch.float32, device)
    view = logits[:, :200]
    targets = targets % 200
    torch.testing.assert_close(token_logprobs(view, targets), token_logprobs_ref(view, targets))


def test_ref_matches_formula():
    logits, targets = _case(6, 50, torch.float32, "cpu")
    x = logits.double()
    expected = x.gather(1, targets[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    torch.testing.assert_close(token_logprobs_ref(logits, targets).double(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_realistic(dtype):
    logits, targets = _case(512, 128256, dtype, "cuda")
    torch.testing.assert_close(
        token_logprobs(logits, targets), token_logprobs_ref(logits, targets), atol=2e-4, rtol=1e-5
    )
