"""BlockManager: allocation, reference counts, prefix caching, eviction, forks."""

import pytest

from batchgen.engine import block_manager as bm_module
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence
from batchgen.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id, tokens):
    return Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams(max_tokens=8))


def admit_and_compute(bm, seq, max_cached=None):
    """Admit seq with a prefix lookup, compute all its tokens, register full blocks."""
    limit = seq.num_tokens - 1 if max_cached is None else max_cached
    hits = bm.get_computed_blocks(seq, limit)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits


def check_refcounts(bm, seqs):
    holders = {}
    for seq in seqs:
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)


def test_allocate_and_free_refcounts():
    bm = BlockManager(8, BS)
    seq = make_seq(0, range(10))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2)  # positions 10, 11 still fit in block 2
    assert len(seq.block_table) == 3
    assert bm.allocate_slots(seq, 3)  # 10 + 3 = 13 tokens -> 4 blocks
    assert len(seq.block_table) == 4
    check_refcounts(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    check_refcounts(bm, [])


def test_allocate_slots_all_or_nothing():
    bm = BlockManager(4, BS)
    a = make_seq(0, range(12))
    admit_and_compute(bm, a)  # 3 blocks, all full and registered
    bm.free(a)
    b = make_seq(1, list(range(12)) + [99] * 5)  # 17 tokens: 3 cached blocks + 2 new
    hits = bm.get_computed_blocks(b, b.num_tokens - 1)
    assert len(hits) == 3
    # The 3 hits are free, so they come out of the pool too: 5 > 4 -> refused, nothing changed.
    assert not bm.allocate_slots(b, 5, hits)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in bm.blocks)
    assert len(bm.cached) == 3  # no eviction happened
    assert bm.allocate_slots(b, 1, hits)  # 13 tokens -> 4 blocks: fits exactly
    assert b.block_table[:3] == hits and b.num_computed_tokens == 12
    check_refcounts(bm, [b])


def test_prefix_hit_on_identical_prefix():
    bm = BlockManager(16, BS)
    a = make_seq(0, range(14))
    assert admit_and_compute(bm, a) == []
    b = make_seq(1, range(14))
    hits = admit_and_compute(bm, b)
    assert hits == a.block_table[:3]  # 13 cacheable tokens -> 3 full blocks
    assert b.num_computed_tokens == 14
    for blk in hits:
        assert bm.blocks[blk].ref_count == 2
    check_refcounts(bm, [a, b])


def test_miss_after_differing_token():
    bm = BlockManager(16, BS)
    a = make_seq(0, range(16))
    admit_and_compute(bm, a)
    tokens = list(range(16))
    tokens[5] = 77  # inside block 1
    b = make_seq(1, tokens)
    assert bm.get_computed_blocks(b, 15) == a.block_table[:1]


def test_lookup_limit():
    bm = BlockManager(16, BS)
    a = make_seq(0, range(16))
    admit_and_compute(bm, a)
    b = make_seq(1, range(16))
    assert len(bm.get_computed_blocks(b, 16)) == 4
    assert len(bm.get_computed_blocks(b, 15)) == 3  # generation: keep >= 1 token to compute
    assert len(bm.get_computed_blocks(b, 7)) == 1  # scoring: score_from - 1


def test_hash_collision_never_gives_wrong_blocks(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens: 42)
    bm = BlockManager(32, BS)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit_and_compute(bm, a)
    # Block 1 of a holds [5..8]; a sequence starting with [5..8] must not hit it.
    b = make_seq(1, [5, 6, 7, 8, 1, 2, 3, 4, 0])
    assert bm.get_computed_blocks(b, 8) == []
    admit_and_compute(bm, b)
    # c shares block 0 with b but block 1 with a: only the first block may hit.
    c = make_seq(2, [5, 6, 7, 8, 5, 6, 7, 8, 0])
    assert bm.get_computed_blocks(c, 8) == b.block_table[:1]
    # True hits still work through the all-colliding hash.
    d = make_seq(3, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.get_computed_blocks(d, 8) == a.block_table[:2]


def test_evicted_parent_breaks_chain(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens: 42)
    bm = BlockManager(2, BS)
    a = make_seq(0, [1, 1, 1, 1, 2, 2, 2, 2])
    admit_and_compute(bm, a, max_cached=0)
    bm.free(a)  # both blocks cached and free; a's block 1 is evicted last
    b = make_seq(1, [3, 3, 3, 3])
    admit_and_compute(bm, b, max_cached=0)  # takes a's block 0 (LRU) for [3,3,3,3]
    # Block 1 of a survives, chained to a serial that no longer exists: no hit through it.
    c = make_seq(2, [3, 3, 3, 3, 2, 2, 2, 2, 0])
    assert bm.get_computed_blocks(c, 8) == b.block_table[:1]


def test_cached_block_reused_after_owner_freed():
    bm = BlockManager(8, BS)
    a = make_seq(0, range(9))
    admit_and_compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = make_seq(1, list(range(8)) + [50, 51])
    hits = admit_and_compute(bm, b)
    assert hits == a_blocks[:2] and b.num_computed_tokens == 10
    assert bm.num_used_blocks == 3
    check_refcounts(bm, [b])


def test_lru_eviction_order_of_free_cached_blocks():
    bm = BlockManager(6, BS)
    seqs = [make_seq(i, [i] * 8) for i in range(3)]  # 2 full blocks each
    for seq in seqs:
        admit_and_compute(bm, seq, max_cached=0)
    tables = [list(s.block_table) for s in seqs]
    for seq in seqs:  # freed in order 0, 1, 2; each table tail first
        bm.free(seq)
    order = [tables[0][1], tables[0][0], tables[1][1], tables[1][0], tables[2][1], tables[2][0]]
    assert list(bm.free_queue) == order
    # Taking 3 fresh blocks evicts seq 0's blocks, then seq 1's tail block.
    c = make_seq(9, [9] * 12)
    assert bm.allocate_slots(c, 12)
    assert c.block_table == order[:3]
    assert bm.get_computed_blocks(make_seq(10, [0] * 9), 8) == []
    assert bm.get_computed_blocks(make_seq(11, [1] * 9), 8) == tables[1][:1]  # chain stops
    assert bm.get_computed_blocks(make_seq(12, [2] * 9), 8) == tables[2]


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS)
    a = make_seq(0, range(6))  # block 0 full (cached), block 1 partial
    admit_and_compute(bm, a)
    full, partial = a.block_table
    bm.free(a)
    assert list(bm.free_queue)[0] == partial
    assert list(bm.free_queue)[-1] == full


def test_hit_on_block_in_use_costs_no_free_block():
    bm = BlockManager(3, BS)
    a = make_seq(0, range(9))
    admit_and_compute(bm, a)  # 3 blocks, cache full
    b = make_seq(1, list(range(8)) + [70])
    hits = bm.get_computed_blocks(b, 8)
    assert hits == a.block_table[:2]
    assert not bm.allocate_slots(b, 1, hits)  # needs one fresh block, none free
    bm.free(a)
    assert bm.allocate_slots(b, 1, hits)


def test_cache_full_blocks_is_idempotent():
    bm = BlockManager(8, BS)
    a = make_seq(0, range(10))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert len(bm.cached) == 1
    bm.cache_full_blocks(a)
    assert len(bm.cached) == 1
    assert bm.allocate_slots(a, 4)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(a)
    assert len(bm.cached) == 2
    assert sum(len(v) for v in bm.cached.values()) == 2


def test_duplicate_blocks_both_registered_and_hit():
    bm = BlockManager(8, BS)
    a, b = make_seq(0, range(9)), make_seq(1, range(9))
    for seq in (a, b):  # computed concurrently: neither sees the other's blocks
        assert bm.allocate_slots(seq, 9)
        seq.num_computed_tokens = 9
        bm.cache_full_blocks(seq)
    bm.free(a)
    # Only b's blocks stay in use; a lookup prefers them (no free block consumed).
    assert bm.get_computed_blocks(make_seq(2, range(9)), 8) == b.block_table[:2]


def test_prefix_caching_off():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(0, range(9))
    admit_and_compute(bm, a)
    assert bm.cached == {}
    assert bm.get_computed_blocks(make_seq(1, range(9)), 8) == []


def test_fork_shares_blocks():
    # What the scheduler does for sample k > 0: admit it on the parent's full prompt blocks.
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    parent = make_seq(0, range(10))
    admit_and_compute(bm, parent)
    child = make_seq(1, range(10))
    assert bm.allocate_slots(child, 2, parent.block_table[:2])
    assert child.block_table[:2] == parent.block_table[:2] and child.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    check_refcounts(bm, [parent, child])
    bm.free(parent)
    check_refcounts(bm, [child])
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_cache_stats_and_can_ever_fit():
    bm = BlockManager(4, BS)
    bm.record_cache_query(10, 8)
    bm.record_cache_query(10, 0)
    assert (bm.num_cache_queries_tokens, bm.num_cache_hit_tokens) == (20, 8)
    assert bm.hit_rate == pytest.approx(0.4)
    assert bm.can_ever_fit(16) and not bm.can_ever_fit(17)
