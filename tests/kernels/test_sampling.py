"""Counter-based noise and Gumbel-max sampling: kernels vs references (bit-exact), the reference
vs a plain-Python statement of the hash, and the sampler's distribution."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.sampling import (
    gumbel_argmax,
    gumbel_argmax_ref,
    uniform_noise,
    uniform_noise_ref,
)

M32 = 0xFFFFFFFF
SEEDS = [0, 1, 42, -1, -(2**63), 2**62 + 7, 123456789]
STEPS = [0, 3, 1000, 1, 2**40, 7, 0]


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _uniform_python(seed: int, step: int, i: int) -> float:
    seed, step = seed & 0xFFFFFFFFFFFFFFFF, step & 0xFFFFFFFFFFFFFFFF
    h = _mix(((seed >> 32) + 0x9E3779B9) & M32)
    h = _mix(h ^ (seed & M32))
    h = _mix(h ^ (step & M32))
    k1 = _mix(h ^ (step >> 32))
    k2 = _mix(k1 ^ 0x85EBCA6B)
    x = _mix(_mix(i ^ k1) ^ k2)
    return ((x >> 9) + 0.5) / 2**23


def _rows():
    return torch.tensor(SEEDS), torch.tensor(STEPS)


def test_ref_matches_python_hash():
    seeds, steps = _rows()
    u = uniform_noise_ref(seeds, steps, 300)
    for b, (seed, step) in enumerate(zip(SEEDS, STEPS)):
        for i in (0, 1, 2, 255, 299):
            assert u[b, i].item() == _uniform_python(seed, step, i)


def test_ref_values_are_pinned():
    # Changing the hash changes every sampled token: do it deliberately, then update these.
    u = uniform_noise_ref(torch.tensor([0, 42]), torch.tensor([0, 3]), 4)
    bits = (u * 2**23 - 0.5).long().tolist()
    assert bits == [[4180532, 7373107, 1939367, 263857], [1003233, 6639026, 6703011, 8104795]]


def test_ref_range_and_independence():
    seeds, steps = _rows()
    u = uniform_noise_ref(seeds, steps, 20000)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # Rows are a function of their own (seed, step) alone: batch composition does not matter.
    alone = uniform_noise_ref(seeds[2:3], steps[2:3], 20000)
    assert torch.equal(alone[0], u[2])
    # Neighbouring steps and seeds are uncorrelated.
    nxt = uniform_noise_ref(seeds, steps + 1, 20000)
    corr = torch.corrcoef(torch.stack([u[0], nxt[0], u[1]]))
    assert corr[0, 1].abs() < 0.05 and corr[0, 2].abs() < 0.05


def test_uniform_noise_kernel_is_bit_exact(device):
    seeds, steps = _rows()
    out = uniform_noise(seeds.to(device), steps.to(device), 5000)
    assert torch.equal(out.cpu(), uniform_noise_ref(seeds, steps, 5000))


@pytest.mark.parametrize("vocab", [5, 2048, 5000, 20000])
def test_gumbel_argmax_matches_ref(device, vocab):
    seeds, steps = _rows()
    logits = 3 * torch.randn(len(SEEDS), vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, ::2] = float("-inf")  # filtered (top-k / top-p) entries
    logits[2, :] = float("-inf")
    logits[2, vocab - 1] = 0.0  # a single allowed token
    got = gumbel_argmax(logits.to(device), seeds.to(device), steps.to(device))
    expected = gumbel_argmax_ref(logits, seeds, steps)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == expected.tolist()
    assert expected[2].item() == vocab - 1 and expected[1].item() % 2 == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gumbel_argmax_divides_by_temperature(device, dtype):
    seeds, steps = _rows()
    vocab = 3000
    logits = 4 * torch.randn(len(SEEDS), vocab, generator=torch.Generator().manual_seed(1))
    logits = logits.to(dtype)
    temps = torch.tensor([0.3, 1.0, 0.7, 2.5, 0.05, 1.3, 0.9])
    got = gumbel_argmax(logits.to(device), seeds.to(device), steps.to(device), temps.to(device))
    # The sampler's unfused path: widen, divide, then draw.
    expected = gumbel_argmax_ref(logits.float() / temps[:, None], seeds, steps)
    assert got.cpu().tolist() == expected.tolist()
    assert gumbel_argmax_ref(logits, seeds, steps, temps).tolist() == expected.tolist()
    # Temperature changes the draw somewhere (else this test would not see it).
    assert expected.tolist() != gumbel_argmax_ref(logits.float(), seeds, steps).tolist()


def test_gumbel_argmax_all_masked_row_picks_first(device):
    logits = torch.full((1, 100), float("-inf"))
    got = gumbel_argmax(
        logits.to(device), torch.tensor([5], device=device), torch.tensor([0], device=device)
    )
    assert got.item() == gumbel_argmax_ref(logits, torch.tensor([5]), torch.tensor([0])).item() == 0


def test_gumbel_argmax_rejects_bad_args(device):
    logits = torch.randn(2, 10, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="float32"):
        gumbel_argmax(logits.half(), seeds, seeds)
    with pytest.raises(ValueError, match="steps must be"):
        gumbel_argmax(logits, seeds, seeds.int())


def test_gumbel_ref_samples_the_softmax():
    # Steps 0..N-1 of one request: token frequencies follow softmax(logits).
    n = 20000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf")]]).expand(n, 5).contiguous()
    tokens = gumbel_argmax_ref(logits, torch.full((n,), 7), torch.arange(n))
    freq = torch.bincount(tokens, minlength=5).double() / n
    probs = torch.softmax(logits[0].double(), dim=0)
    assert freq[4] == 0
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_gumbel_argmax_scans_chunks_in_parallel(device):
    # Few rows and a large vocabulary: each row is split over several programs, whose bests are
    # combined; the winner may sit in any chunk, and an all-masked row still picks index 0.
    from batchgen.kernels.sampling import _num_chunks

    vocab = 40000
    assert _num_chunks(2, vocab, torch.device(device)) > 1
    seeds, steps = torch.tensor([3, 4]), torch.tensor([0, 9])
    logits = torch.full((2, vocab), float("-inf"))
    for where in (5, 17000, vocab - 1):  # one allowed token, in the first, a middle, the last chunk
        logits[0] = float("-inf")
        logits[0, where] = 1.0
        got = gumbel_argmax(logits.to(device), seeds.to(device), steps.to(device))
        assert got.cpu().tolist() == [where, 0]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    got = gumbel_argmax(logits.to(device), seeds.to(device), steps.to(device))
    assert got.cpu().tolist() == gumbel_argmax_ref(logits, seeds, steps).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("b", [3, 256])
def test_gumbel_argmax_realistic(b):
    vocab = 151936
    logits = torch.randn(b, vocab, device="cuda") / 0.6
    seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda")
    steps = torch.randint(0, 2000, (b,), device="cuda")
    assert torch.equal(gumbel_argmax(logits, seeds, steps), gumbel_argmax_ref(logits, seeds, steps))
    assert torch.equal(uniform_noise(seeds, steps, vocab), uniform_noise_ref(seeds, steps, vocab))
