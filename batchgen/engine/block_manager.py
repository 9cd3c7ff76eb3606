"""BlockManager: paged KV-cache block allocation with prefix caching (pure Python)."""

from __future__ import annotations

from collections import OrderedDict

from batchgen.engine.block import Block
from batchgen.engine.sequence import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of a full block: h_i = hash((h_{i-1}, tokens of block i)).

    Python's hash is stable within a process, which is all the cache needs. Hits are confirmed
    by tokens and parent identity, so a collision costs a miss, never wrong KV.
    """
    return hash((parent_hash, token_ids))


class BlockManager:
    """Owns the block pool: free queue (LRU), prefix-cache map, per-block reference counts.

    Args:
        num_blocks: KV blocks in the cache.
        block_size: token slots per block.
        enable_prefix_caching: register full computed blocks and reuse them across sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first; popped from the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # hash -> {block_id: block}: several blocks may share a hash (duplicates or collisions).
        self.cached: dict[int, dict[int, Block]] = {}
        self._next_serial = 1
        # seq_id -> leading blocks of its table known to be registered (cache_full_blocks resumes).
        self._num_hashed: dict[int, int] = {}
        self.num_cache_queries_tokens = 0
        self.num_cache_hit_tokens = 0

    # ---- stats -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_cache_hit_tokens / max(self.num_cache_queries_tokens, 1)

    def record_cache_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a first admission's prompt tokens and those served by cache or fork."""
        self.num_cache_queries_tokens += num_query_tokens
        self.num_cache_hit_tokens += num_hit_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.num_blocks

    # ---- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence, max_cached_tokens: int) -> list[int]:
        """Cached blocks holding seq's leading full blocks, covering at most max_cached_tokens.

        Walks block by block and stops at the first miss. A candidate counts only if its tokens
        equal the block's tokens and it was chained to a block already confirmed at the previous
        position, so the returned blocks hold exactly this sequence's prefix. Does not take the
        blocks; pass them to allocate_slots.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        num_full = min(max_cached_tokens, seq.num_tokens) // bs
        hits: list[int] = []
        parent_hash: int | None = None
        confirmed_serials = {0}  # serials of blocks proven to hold the prefix so far
        for i in range(num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, tokens)
            matches = [
                b
                for b in self.cached.get(block_hash, {}).values()
                if b.parent_serial in confirmed_serials and b.token_ids == tokens
            ]
            if not matches:
                break
            # Prefer a block already in use: it costs nothing from the free pool.
            hits.append(max(matches, key=lambda b: b.ref_count > 0).block_id)
            confirmed_serials = {b.serial for b in matches}
            parent_hash = block_hash
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are full, computed and whose token ids are all known (a
        token still pending on the device defers its block to a later call); already
        registered ones are kept."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        known = min(seq.num_computed_tokens, seq.num_known_tokens)
        num_full = min(known // bs, len(seq.block_table))
        start = self._num_hashed.get(seq.seq_id, 0)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:  # a cache hit, a fork, or done by a previous call
                continue
            if i == 0:
                parent_hash, parent_serial = None, 0
            else:
                parent = self.blocks[seq.block_table[i - 1]]
                parent_hash, parent_serial = parent.block_hash, parent.serial
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, tokens)
            block.register(block_hash, tokens, self._next_serial, parent_serial)
            self._next_serial += 1
            self.cached.setdefault(block_hash, {})[block.block_id] = block
        if num_full > start:
            self._num_hashed[seq.seq_id] = num_full

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        reserve: int = 0,
    ) -> bool:
        """Grow seq.block_table to cover num_computed_tokens + num_new_tokens tokens.

        Args:
            seq: the sequence.
            num_new_tokens: tokens to be computed this step.
            computed_blocks: on admission, blocks already holding seq's leading tokens (from
                get_computed_blocks or a parent's prompt); they are taken first and
                seq.num_computed_tokens becomes len(computed_blocks) * block_size.
            reserve: free blocks that must remain after this allocation.

        Returns:
            False, changing nothing, if the free pool is too small; True otherwise.
        """
        computed_blocks = computed_blocks or []
        if computed_blocks:
            assert not seq.block_table, (
                f"seq {seq.seq_id}: computed blocks given to a non-empty table"
            )
            num_computed = len(computed_blocks) * self.block_size
        else:
            num_computed = seq.num_computed_tokens
        num_table = len(seq.block_table) + len(computed_blocks)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size) - num_table
        # Cached hits that are currently free leave the free pool too.
        num_from_pool = max(num_needed, 0) + sum(
            1 for b in computed_blocks if self.blocks[b].ref_count == 0
        )
        if num_from_pool + reserve > len(self.free_queue):
            return False
        for block_id in computed_blocks:
            self._take(block_id)
        if computed_blocks:
            seq.block_table = list(computed_blocks)
            seq.num_computed_tokens = num_computed
        for _ in range(num_needed):
            seq.block_table.append(self._allocate_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first, so its last blocks are the first evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    # Holds nothing reusable: hand it out before any cached block.
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        self._num_hashed.pop(seq.seq_id, None)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _allocate_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: drop the stale cache entry
            bucket = self.cached[block.block_hash]
            del bucket[block_id]
            if not bucket:
                del self.cached[block.block_hash]
            block.reset()
        block.ref_count = 1
        return block_id
