"""Block: one paged KV-cache block's bookkeeping (reference count and prefix-cache identity)."""

from __future__ import annotations


class Block:
    """A KV block of `block_size` token slots.

    A block is *registered* in the prefix cache once it is full and computed: it then carries
    the chained hash of its prefix, its own tokens and the serial number of the block it was
    chained to. Serials are never reused, so a hit confirmed by tokens and parent serial, block
    by block from the start, proves the whole prefix is identical even if hashes collide.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "serial", "parent_serial")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.serial = 0  # 0: not registered
        self.parent_serial = 0  # 0: first block of a sequence (or not registered)

    def register(
        self, block_hash: int, token_ids: tuple[int, ...], serial: int, parent_serial: int
    ) -> None:
        self.block_hash = block_hash
        self.token_ids = token_ids
        self.serial = serial
        self.parent_serial = parent_serial

    def reset(self) -> None:
        """Forget the cached identity (the block is about to hold other tokens)."""
        self.block_hash = None
        self.token_ids = None
        self.serial = 0
        self.parent_serial = 0

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"
