"""StepInputs: flatten one scheduled step into host lists for the model runner."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from batchgen.engine.scheduler_output import ScheduledSequence
from batchgen.engine.sequence import PENDING_TOKEN


@dataclass
class StepInputs:
    """Host-side (pure Python) description of one forward step over a ragged batch.

    Attributes:
        input_ids, positions, slot_mapping: [T] per new token.
        cu_seqlens_q: [B+1] offsets of each sequence's new tokens; seq_lens: [B] context lengths.
        block_tables: [B] lists of block ids.
        sample_rows: flat token index of each sampling sequence's last token, in batch order.
        score_rows / score_targets / score_owner: for scoring sequences, the flat index whose
            logits predict a candidate token, that token, and the owning batch row.
        num_decode_rows: leading rows with exactly one new token (the scheduler puts them
            first); attention sends them to the decode kernel.
        pending_rows / pending_seqs: flat indices whose input token was sampled by the step still
            in flight (its id is on the device only; input_ids holds PENDING_TOKEN there), and
            the sequences they belong to.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_owner: list[int] = field(default_factory=list)
    num_decode_rows: int = 0
    pending_rows: list[int] = field(default_factory=list)
    pending_seqs: list = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)

    @property
    def max_seqlen_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens_q, self.cu_seqlens_q[1:]))


def describe_step(step: StepInputs) -> str:
    """One line of a step's shape (tensor-parallel step logs): tokens, sequences, decode rows,
    prompt chunks, sampled / scored / pending rows, widest block table."""
    d = step.num_decode_rows
    width = max(map(len, step.block_tables), default=0)
    return (
        f"tokens={len(step.input_ids)} seqs={len(step.seq_lens)} decode={d} "
        f"chunks={len(step.seq_lens) - d} sample={len(step.sample_rows)} "
        f"score={len(step.score_rows)} pending={len(step.pending_rows)} blocks={width}"
    )


def build_step_inputs(scheduled: list[ScheduledSequence], block_size: int) -> StepInputs:
    """Gather token ids, positions and cache slots for each scheduled chunk, in batch order."""
    step = StepInputs()
    step.num_decode_rows = next(
        (row for row, item in enumerate(scheduled) if item.num_new_tokens != 1), len(scheduled)
    )
    for row, item in enumerate(scheduled):
        seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
        if item.num_new_tokens == 1 and seq.score_from is None:  # decode: the common case
            token = seq.token_ids[start]
            if token == PENDING_TOKEN:
                step.pending_rows.append(step.cu_seqlens_q[-1])
                step.pending_seqs.append(seq)
            step.input_ids.append(token)
            step.positions.append(start)
            block, offset = divmod(start, block_size)
            step.slot_mapping.append(seq.block_table[block] * block_size + offset)
            flat = step.cu_seqlens_q[-1]
            step.cu_seqlens_q.append(flat + 1)
            step.seq_lens.append(end)
            step.block_tables.append(seq.block_table)
            if item.samples:
                step.sample_rows.append(flat)
            continue
        step.input_ids.extend(seq.token_ids[start:end])
        assert seq.token_ids[end - 1] != PENDING_TOKEN, f"{seq}: a chunk ends in a pending token"
        step.positions.extend(range(start, end))
        # One range per touched block instead of one Python op per token.
        pos = start
        while pos < end:
            block, offset = divmod(pos, block_size)
            take = min(block_size - offset, end - pos)
            base = seq.block_table[block] * block_size + offset
            step.slot_mapping.extend(range(base, base + take))
            pos += take
        flat_start = step.cu_seqlens_q[-1]
        step.cu_seqlens_q.append(flat_start + item.num_new_tokens)
        step.seq_lens.append(end)
        step.block_tables.append(seq.block_table)
        if item.samples:
            step.sample_rows.append(flat_start + item.num_new_tokens - 1)
        if seq.score_from is not None:
            # Position p's logits predict token p + 1; candidates occupy [score_from, num_tokens).
            for p in range(max(start, seq.score_from - 1), min(end, seq.num_tokens - 1)):
                step.score_rows.append(flat_start + p - start)
                step.score_targets.append(seq.token_ids[p + 1])
                step.score_owner.append(row)
    return step


def pad_block_tables(tables: list[list[int]], multiple: int = 1) -> np.ndarray:
    """[B] ragged block-id lists -> [B, width] int32, zero padded, width the longest list
    rounded up to `multiple` (numpy: ~5x faster than building padded Python lists for a few
    hundred sequences). A width that is always a multiple of 16 keeps Triton from compiling a
    second variant of the attention kernels for the other widths."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = -(-int(lens.max()) // multiple) * multiple
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width)[None, :] < lens[:, None]] = flat
    return out
