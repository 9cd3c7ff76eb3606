"""Packed token bitmasks: the references against masks packed and applied in plain Python, the
apply kernel and both sampling kernels' masked draws against their references (bit for bit)."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels import ops
from batchgen.kernels.sampling import gumbel_argmax, gumbel_argmax_ref
from batchgen.kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    bitmask_words,
    unpack_bitmask_ref,
)
from batchgen.kernels.top_k_top_p import top_k_top_p_sample, top_k_top_p_sample_ref


def _pack(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """[B, ceil(V / 32)] int32 from per-row allowed id lists, word by word in Python."""
    words = []
    for ids in allowed:
        row = [0] * bitmask_words(vocab)
        for i in ids:
            row[i // 32] |= 1 << (i % 32)
        words.append([w - (1 << 32) if w >= 1 << 31 else w for w in row])  # as int32
    return torch.tensor(words, dtype=torch.int32)


def _allowed(rows: int, vocab: int, seed: int) -> list[list[int]]:
    """Per row a different allowed set: sparse, dense, one token, the last token, all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        kind = r % 5
        if kind == 0:
            out.append(sorted(torch.randperm(vocab, generator=g)[: max(1, vocab // 50)].tolist()))
        elif kind == 1:
            out.append([i for i in range(vocab) if torch.rand(1, generator=g).item() < 0.7])
        elif kind == 2:
            out.append([int(torch.randint(vocab, (1,), generator=g))])
        elif kind == 3:
            out.append([vocab - 1, 0])
        else:
            out.append(list(range(vocab)))
    return out


def _masked_python(logits: torch.Tensor, allowed: list[list[int]]) -> torch.Tensor:
    out = torch.full(logits.shape, float("-inf"))
    for r, ids in enumerate(allowed):
        out[r, ids] = logits[r, ids].float()
    return out


def _case(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    steps = torch.randint(0, 5000, (rows,), generator=g)
    temps = 0.2 + 1.5 * torch.rand(rows, generator=g)
    return logits, seeds, steps, temps


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 2049])
def test_unpack_ref_equals_python_bits(vocab):
    allowed = _allowed(6, vocab, vocab)
    got = unpack_bitmask_ref(_pack(allowed, vocab), vocab)
    assert got.shape == (6, vocab) and got.dtype == torch.bool
    for r, ids in enumerate(allowed):
        assert got[r].nonzero().flatten().tolist() == sorted(set(ids)), f"row {r}"


@pytest.mark.parametrize("vocab", [33, 2048, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_kernel_matches_ref(device, vocab, dtype):
    logits = _case(6, vocab, vocab, dtype)[0]
    allowed = _allowed(6, vocab, 1)
    mask = _pack(allowed, vocab)
    want = apply_token_bitmask_ref(logits, mask)
    assert torch.equal(want, _masked_python(logits, allowed))
    got = apply_token_bitmask(logits.to(device), mask.to(device))
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), want)
    assert torch.equal(ops.apply_token_bitmask(logits, mask), want)  # the CPU dispatch


@pytest.mark.parametrize("vocab", [5, 2048, 5000, 20000])
def test_gumbel_argmax_with_bitmask_matches_ref(device, vocab):
    rows = 7
    logits, seeds, steps, temps = _case(rows, vocab, vocab)
    allowed = _allowed(rows, vocab, vocab + 1)
    mask = _pack(allowed, vocab)
    want = gumbel_argmax_ref(logits, seeds, steps, temps, mask)
    # Independent: the unmasked draw over logits masked in Python, tempered first.
    tempered = logits / temps[:, None]
    assert (
        want.tolist() == gumbel_argmax_ref(_masked_python(tempered, allowed), seeds, steps).tolist()
    )
    for r, ids in enumerate(allowed):
        assert want[r].item() in ids
    args = [t.to(device) for t in (logits, seeds, steps, temps, mask)]
    assert gumbel_argmax(*args).cpu().tolist() == want.tolist()
    assert ops.sample_gumbel(logits, seeds, steps, temps, mask).tolist() == want.tolist()


@pytest.mark.parametrize("vocab", [7, 2049, 5000])
@pytest.mark.parametrize(
    "which", [[], ["top_k"], ["top_p"], ["min_p"], ["top_k", "top_p", "min_p"]]
)
def test_top_k_top_p_with_bitmask_matches_ref(device, vocab, which):
    rows = 10
    logits, seeds, steps, temps = _case(rows, vocab, vocab + 7)
    allowed = _allowed(rows, vocab, vocab + 2)
    mask = _pack(allowed, vocab)
    kw = {
        "top_k": torch.tensor([3, 0, 40, 1, 7, 2, 500, 0, 5, 9], dtype=torch.int32),
        "top_p": torch.tensor([0.9, 0.5, 1.0, 0.3, 0.99, 0.7, 0.05, 0.8, 0.6, 1.0]),
        "min_p": torch.tensor([0.1, 0.0, 0.5, 0.01, 0.9, 0.2, 0.0, 0.3, 0.05, 0.0]),
    }
    kw = {k: v for k, v in kw.items() if k in which}
    want = top_k_top_p_sample_ref(logits, seeds, steps, temps, **kw, bitmask=mask)
    # Independent: the unmasked reference over logits masked in Python (the filters then rank
    # and weigh the allowed tokens only).
    plain = top_k_top_p_sample_ref(_masked_python(logits, allowed), seeds, steps, temps, **kw)
    assert want.tolist() == plain.tolist()
    for r, ids in enumerate(allowed):
        assert want[r].item() in ids
    dev = {k: v.to(device) for k, v in kw.items()}
    args = [t.to(device) for t in (logits, seeds, steps, temps)]
    got = top_k_top_p_sample(*args, **dev, bitmask=mask.to(device))
    assert got.cpu().tolist() == want.tolist()


def test_masked_draw_differs_from_the_unmasked_one():
    # The mask is applied, not ignored: a row whose unmasked draw is disallowed moves.
    logits, seeds, steps, temps = _case(4, 500, 3)
    free = gumbel_argmax_ref(logits, seeds, steps, temps)
    allowed = [[i for i in range(500) if i != t] for t in free.tolist()]
    got = gumbel_argmax_ref(logits, seeds, steps, temps, _pack(allowed, 500))
    assert all(a != b for a, b in zip(got.tolist(), free.tolist()))


def test_bitmask_shape_is_checked(device):
    logits = torch.randn(2, 100, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    temps = torch.ones(2, device=device)
    good = torch.full((2, 4), -1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"bitmask must be \[2, 4\] int32"):
        gumbel_argmax(logits, seeds, seeds, temps, good[:, :3].contiguous())
    with pytest.raises(ValueError, match="bitmask must be"):
        top_k_top_p_sample(logits, seeds, seeds, temps, bitmask=good.long())
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask(logits, good[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("b", [3, 256])
def test_masked_draws_realistic(b):
    vocab = 151936
    g = torch.Generator(device="cuda").manual_seed(b)
    logits = (4 * torch.randn(b, vocab, device="cuda", generator=g)).bfloat16()
    seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
    steps = torch.randint(0, 2000, (b,), device="cuda", generator=g)
    temps = torch.full((b,), 0.6, device="cuda")
    words = bitmask_words(vocab)
    mask = torch.randint(-(2**31), 2**31 - 1, (b, words), device="cuda", generator=g)
    mask = mask.to(torch.int32)
    mask[0] = 0
    mask[0, 7] = 1 << 3  # one allowed token: 227
    want = gumbel_argmax_ref(logits, seeds, steps, temps, mask)
    assert want[0].item() == 227
    assert torch.equal(gumbel_argmax(logits, seeds, steps, temps, mask), want)
    top_p = torch.full((b,), 0.9, device="cuda")
    got = top_k_top_p_sample(logits, seeds, steps, temps, top_p=top_p, bitmask=mask)
    assert torch.equal(
        got, top_k_top_p_sample_ref(logits, seeds, steps, temps, None, top_p, None, mask)
    )
    assert torch.equal(apply_token_bitmask(logits, mask), apply_token_bitmask_ref(logits, mask))
