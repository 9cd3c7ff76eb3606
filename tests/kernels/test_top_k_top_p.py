"""Top-k / top-p / min-p sampling: the kept-set rules of the reference against a plain-Python
statement of them, the kernel against the reference (same tokens), and the draw's distribution."""

from __future__ import annotations

import math

import pytest
import torch
from batchgen.kernels.sampling import gumbel_argmax_ref
from batchgen.kernels.top_k_top_p import (
    launch_top_k_top_p,
    sortable_keys_ref,
    top_k_top_p_mask_ref,
    top_k_top_p_sample,
    top_k_top_p_sample_ref,
)

FILTERS = ["top_k", "top_p", "min_p"]


def _mask_python(z: list[float], k: int, p: float, min_p: float) -> list[bool]:
    """The module's rules, token by token: top-k by the k-th largest value (ties kept), top-p by
    the mass strictly above over the top-k set's mass, min-p against the max."""
    vocab = len(z)
    top = max(z)
    kth = sorted(z, reverse=True)[k - 1] if 0 < k < vocab else -math.inf
    in_k = [x >= kth for x in z]
    e = [math.exp(x - top) for x in z]
    total = sum(ei for ei, ok in zip(e, in_k) if ok)
    keep = []
    for x, ok in zip(z, in_k):
        above = sum(ej for xj, ej in zip(z, e) if xj > x)
        nucleus = p >= 1.0 or above < p * total
        floor = min_p <= 0 or x - top >= math.log(min_p)
        keep.append(ok and nucleus and floor)
    return keep


def _filters(rows: int, which, gen: torch.Generator) -> dict:
    """Per-row settings for the filters named in `which`, some rows off."""
    out = {}
    if "top_k" in which:
        out["top_k"] = torch.tensor([(0, 1, 3, 40, -1, 7, 500, 2)[i % 8] for i in range(rows)])
        out["top_k"] = out["top_k"].to(torch.int32)
    if "top_p" in which:
        out["top_p"] = torch.tensor(
            [(1.0, 0.9, 0.5, 0.05, 0.99, 0.7, 0.3)[i % 7] for i in range(rows)]
        )
    if "min_p" in which:
        out["min_p"] = torch.tensor([(0.0, 0.1, 0.5, 0.01, 0.9)[i % 5] for i in range(rows)])
    return out


def _to(kw: dict, device) -> dict:
    return {k: v.to(device) for k, v in kw.items()}


def _case(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    steps = torch.randint(0, 5000, (rows,), generator=g)
    temps = 0.2 + 1.5 * torch.rand(rows, generator=g)
    return logits, seeds, steps, temps


def test_sortable_keys_follow_float_order():
    z = torch.tensor([float("-inf"), -3e38, -2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3e38])
    keys = sortable_keys_ref(z)
    assert keys.dtype == torch.int32
    assert keys.tolist() == sorted(keys.tolist())
    assert keys[5] == keys[6]  # -0.0 and 0.0 are one value
    assert len(set(keys.tolist())) == len(z) - 1


def test_mask_ref_equals_the_rules_token_by_token():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(12, 40, generator=g)
    z[3] = torch.round(z[3] * 2) / 2  # many ties
    z[4, :5] = z[4].max()  # a tied top group
    z[5, ::3] = float("-inf")
    kw = _filters(12, FILTERS, g)
    got = top_k_top_p_mask_ref(z, **kw)
    for r in range(12):
        k, p, mp = kw["top_k"][r].item(), kw["top_p"][r].item(), kw["min_p"][r].item()
        assert got[r].tolist() == _mask_python(z[r].tolist(), k, p, mp), f"row {r}"


def test_mask_ref_examples():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 5))
    kept = top_k_top_p_mask_ref(
        z,
        top_k=torch.tensor([2, 0, 0, 3, 0]),
        top_p=torch.tensor([1.0, 0.7, 0.8, 0.6, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5]),
    )
    assert kept.tolist() == [
        [True, True, False, False],  # top-2
        [True, True, False, False],  # 0.15 has 0.8 above it: out of the 0.7 nucleus
        [True, True, False, False],  # 0.8 above 0.15 is not < 0.8
        [True, True, False, False],  # top-3 renormalised: 0.5 / 0.95 < 0.6, 0.8 / 0.95 is not
        [True, True, False, False],  # min-p 0.5: 0.15 < 0.25
    ]
    # Ties at the boundary stay together; the top token always stays.
    tied = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert top_k_top_p_mask_ref(tied, top_k=torch.tensor([2])).tolist() == [
        [False, True, True, True, False]
    ]
    assert top_k_top_p_mask_ref(tied, top_p=torch.tensor([1e-6])).tolist() == [
        [False, True, True, True, False]
    ]


@pytest.mark.parametrize("vocab", [1, 7, 2048, 2049, 5000])
@pytest.mark.parametrize("which", [[], ["top_k"], ["top_p"], ["min_p"], FILTERS])
def test_kernel_matches_ref(device, vocab, which):
    rows = 9
    logits, seeds, steps, temps = _case(rows, vocab, vocab)
    kw = _filters(rows, which, torch.Generator().manual_seed(1))
    got = top_k_top_p_sample(
        logits.to(device), seeds.to(device), steps.to(device), temps.to(device), **_to(kw, device)
    )
    want = top_k_top_p_sample_ref(logits, seeds, steps, temps, **kw)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == want.tolist()
    if not which:  # no filter: the plain tempered Gumbel-max draw
        assert want.tolist() == gumbel_argmax_ref(logits, seeds, steps, temps).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_narrow_logits(device, dtype):
    logits, seeds, steps, temps = _case(8, 3000, 5, dtype)
    kw = _filters(8, FILTERS, torch.Generator().manual_seed(2))
    got = top_k_top_p_sample(
        logits.to(device), seeds.to(device), steps.to(device), temps.to(device), **_to(kw, device)
    )
    assert (
        got.cpu().tolist()
        == top_k_top_p_sample_ref(logits.float(), seeds, steps, temps, **kw).tolist()
    )


def test_kernel_redraws_above_a_rejected_token(device):
    # Flat rows and small nuclei: the first draw over the whole row mostly falls outside the
    # nucleus, so the kernel must reject it and draw again above it, maybe several times.
    rows, vocab = 16, 3000
    logits, seeds, steps, _ = _case(rows, vocab, 11)
    logits = logits / 6
    temps = torch.ones(rows)
    top_p = torch.tensor([0.02, 0.1, 0.3, 0.5] * 4)
    want = top_k_top_p_sample_ref(logits, seeds, steps, temps, top_p=top_p)
    first = gumbel_argmax_ref(logits, seeds, steps, temps)
    kept = top_k_top_p_mask_ref(logits, top_p=top_p)
    rejected = [not kept[r, first[r]].item() for r in range(rows)]
    assert sum(rejected) >= 8  # the redraw path is what this test checks
    assert all(kept[r, want[r]].item() for r in range(rows))
    got = top_k_top_p_sample(
        logits.to(device),
        seeds.to(device),
        steps.to(device),
        temps.to(device),
        top_p=top_p.to(device),
    )
    assert got.cpu().tolist() == want.tolist()


def test_kernel_ties_and_masked_rows(device):
    rows, vocab = 6, 2500
    logits, seeds, steps, temps = _case(rows, vocab, 4)
    logits = torch.round(logits)  # about 20 distinct values: wide tied groups at every boundary
    logits[1, ::2] = float("-inf")
    logits[2] = float("-inf")  # nothing allowed: index 0, as argmax
    logits[3] = float("-inf")
    logits[3, vocab - 1] = 0.0  # one allowed token
    logits[4, 100:110] = -0.0  # -0.0 and 0.0 are one value
    logits[4, 110:120] = 0.0
    kw = {
        "top_k": torch.tensor([5, 300, 3, 1, 112, 2000], dtype=torch.int32),
        "top_p": torch.tensor([0.4, 0.9, 0.5, 0.5, 0.95, 0.2]),
        "min_p": torch.tensor([0.0, 0.05, 0.0, 0.3, 0.0, 0.01]),
    }
    got = top_k_top_p_sample(
        logits.to(device), seeds.to(device), steps.to(device), temps.to(device), **_to(kw, device)
    )
    want = top_k_top_p_sample_ref(logits, seeds, steps, temps, **kw)
    assert got.cpu().tolist() == want.tolist()
    assert want[2].item() == 0 and want[3].item() == vocab - 1


def _top_k_case(rows: int, vocab: int):
    logits, seeds, steps, temps = _case(rows, vocab, 8)
    logits = logits / 20  # flat: every kept token is a likely draw, so a wrong k-th shows
    logits[::2] = torch.round(logits[::2] * 40) / 40  # ties at the boundary in half the rows
    # Row 1: its 40 largest in one lane of the kernel's loop (every 512th under the interpreter,
    # every BLOCK_V-th on a GPU), so the lanes' maxima bound the 40th far below it.
    for stride in (512, 8192):
        lane = torch.arange(0, vocab, stride)[:40]
        logits[1, lane] = 1 + torch.arange(len(lane), dtype=torch.float32) / 100
    top_k = torch.tensor([1, 2, 3, 17, 100, 750, 1499, 40][:rows], dtype=torch.int32)
    return logits, seeds, steps, temps, top_k


def _check_top_k(device, **options):
    """Eight draws per row (steps 0..7 added) against the reference."""
    logits, seeds, steps, temps, top_k = _top_k_case(8, 1500)
    out = torch.empty(8, dtype=torch.int64, device=device)
    for extra in range(8):
        args = [t.to(device) for t in (logits, seeds, steps + extra, temps, top_k)]
        launch_top_k_top_p(*args, None, None, out, **options)
        want = top_k_top_p_sample_ref(logits, seeds, steps + extra, temps, top_k=top_k)
        assert out.cpu().tolist() == want.tolist(), f"draw {extra}"


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_top_k_radix_select_at_other_digit_widths(device, bits):
    # The k-th largest key is found digit by digit; any width that divides 32 must agree.
    _check_top_k(device, radix_bits=bits, top_k_walk=0)


@pytest.mark.parametrize("walk", [1, 2, 40])
def test_top_k_walk_from_the_lanes_bound(device, walk):
    # Short walks hand over to the radix select midway; a long one settles every row itself.
    _check_top_k(device, top_k_walk=walk)


def test_ref_draws_follow_the_renormalised_nucleus():
    n = 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(n, 4).contiguous()
    tokens = top_k_top_p_sample_ref(
        logits, torch.full((n,), 3), torch.arange(n), torch.ones(n), top_p=torch.full((n,), 0.7)
    )
    freq = torch.bincount(tokens, minlength=4).double() / n
    torch.testing.assert_close(
        freq, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64), atol=0.015, rtol=0
    )


def test_kernel_rejects_bad_args(device):
    logits = torch.randn(2, 10, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    temps = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="logits must be"):
        top_k_top_p_sample(logits.double(), seeds, seeds, temps)
    with pytest.raises(ValueError, match="top_k must be"):
        top_k_top_p_sample(logits, seeds, seeds, temps, top_k=seeds)
    with pytest.raises(ValueError, match="top_p must be"):
        top_k_top_p_sample(logits, seeds, seeds, temps, top_p=temps[:1])
    with pytest.raises(ValueError, match="temperatures must be"):
        top_k_top_p_sample(logits, seeds, seeds, temps.half())


@pytest.mark.gpu
@pytest.mark.parametrize("b", [3, 256])
def test_kernel_realistic(b):
    vocab = 128256
    g = torch.Generator(device="cuda").manual_seed(b)
    logits = (4 * torch.randn(b, vocab, device="cuda", generator=g)).bfloat16()
    seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
    steps = torch.randint(0, 2000, (b,), device="cuda", generator=g)
    temps = torch.full((b,), 0.6, device="cuda")
    kw = _to(_filters(b, FILTERS, torch.Generator().manual_seed(b)), "cuda")
    for which in ([], ["top_p"], FILTERS):
        sub = {k: kw[k] for k in which}
        got = top_k_top_p_sample(logits, seeds, steps, temps, **sub)
        assert torch.equal(got, top_k_top_p_sample_ref(logits, seeds, steps, temps, **sub))
