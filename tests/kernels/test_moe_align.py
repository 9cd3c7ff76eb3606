"""moe_align: kernel vs reference (layout, block experts, expert-use count), reference vs a
direct reading of its contract."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.moe_align import moe_align, moe_align_ref, padded_capacity


def routing(T: int, K: int, E: int, seed: int = 0, experts: list[int] | None = None):
    """[T, K] int32 ids, K distinct experts per token drawn from `experts` (default: all E)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    rows = [pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)]
    return torch.stack(rows).to(torch.int32)


CASES = [
    (1, 1, 4, 16),  # one pair
    (5, 2, 8, 16),
    (3, 2, 32, 16),  # fewer pairs than experts: most experts get no block
    (37, 4, 16, 32),
    (130, 8, 8, 64),  # every expert many blocks, pairs past one kernel loop block (1024)
]


@pytest.mark.parametrize("T, K, E, block_m", CASES)
def test_align_kernel_equals_reference(device, T, K, E, block_m):
    ids = routing(T, K, E, seed=T).to(device)
    slots = torch.arange(T, device=device)
    slots[::3] = -1  # padding tokens: routed, laid out, not counted
    touched, touched_ref = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2))
    got = moe_align(ids, E, block_m, touched, slots)
    want = moe_align_ref(ids, E, block_m, touched_ref, slots)
    n = int(want[2])
    assert int(got[2]) == n
    assert torch.equal(got[0][:n], want[0][:n])
    assert torch.equal(got[1], want[1])  # -1 past the used blocks
    assert int(touched) == int(touched_ref)


def test_align_int64_ids_and_one_expert_for_all(device):
    # All pairs to expert 3 of 4: one long run, the other experts empty.
    ids = torch.full((50, 1), 3, dtype=torch.int64, device=device)
    sorted_ids, expert_ids, num_padded = moe_align(ids, 4, 16)
    assert int(num_padded) == 64
    assert sorted_ids[:50].tolist() == list(range(50))
    assert sorted_ids[50:64].tolist() == [50] * 14
    assert expert_ids.tolist()[:4] == [3] * 4 and set(expert_ids.tolist()[4:]) <= {-1}


def test_reference_layout_reads_as_its_contract():
    T, K, E, block_m = 23, 3, 10, 8
    ids = routing(T, K, E, seed=4, experts=[0, 2, 3, 7, 9])
    sorted_ids, expert_ids, num_padded = moe_align_ref(ids, E, block_m)
    n = int(num_padded)
    assert n % block_m == 0 and n <= padded_capacity(T * K, E, block_m)
    flat = ids.reshape(-1).tolist()
    seen = []
    for b, e in enumerate(expert_ids.tolist()):
        rows = sorted_ids[b * block_m : (b + 1) * block_m].tolist()
        if b * block_m >= n:
            assert e == -1
            continue
        real = [p for p in rows if p < T * K]
        assert all(flat[p] == e for p in real)  # a block holds one expert's pairs
        assert all(p == T * K for p in rows[len(real) :])  # then padding
        seen += real
    assert sorted(seen) == list(range(T * K))  # every pair exactly once
    assert seen == sorted(seen, key=lambda p: flat[p])  # expert by expert, stable


def test_capacity_holds_the_worst_case():
    # Every expert gets one pair: the most padding the layout can need.
    for E, block_m in ((8, 16), (128, 64)):
        ids = torch.arange(E, dtype=torch.int32).reshape(E, 1)
        _, _, num_padded = moe_align_ref(ids, E, block_m)
        assert int(num_padded) == E * block_m == padded_capacity(E, E, block_m)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"\[T, K\] int32/int64"):
        moe_align_ref(torch.zeros(4, dtype=torch.int32), 4, 16)
    with pytest.raises(ValueError, match="power-of-two block_m"):
        moe_align_ref(torch.zeros(4, 2, dtype=torch.int32), 4, 12)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 64, 256, 4096])
@pytest.mark.parametrize("E, K, block_m", [(128, 8, 16), (128, 8, 64), (8, 2, 128)])
def test_align_real_shapes(T, E, K, block_m):
    ids = routing(T, K, E, seed=T).cuda()
    slots = torch.arange(T, device="cuda")
    slots[T // 2 :] = -1
    touched, touched_ref = (torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2))
    got = moe_align(ids, E, block_m, touched, slots)
    want = moe_align_ref(ids, E, block_m, touched_ref, slots)
    n = int(want[2])
    assert int(got[2]) == n and torch.equal(got[0][:n], want[0][:n])
    assert torch.equal(got[1], want[1]) and int(touched) == int(touched_ref)
