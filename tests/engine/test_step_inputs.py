"""build_step_inputs: decode rows first, pending inputs marked; padded block tables."""

from __future__ import annotations

from batchgen.engine.scheduler_output import ScheduledSequence
from batchgen.engine.sequence import PENDING_TOKEN, Sequence
from batchgen.engine.step_inputs import build_step_inputs, pad_block_tables
from batchgen.sampling_params import SamplingParams


def test_pad_block_tables_rounds_width_up():
    tables = [[3, 1], [7], [2, 5, 9]]
    assert pad_block_tables(tables).tolist() == [[3, 1, 0], [7, 0, 0], [2, 5, 9]]
    padded = pad_block_tables(tables, multiple=16)
    assert padded.shape == (3, 16) and padded[:, :3].tolist() == [[3, 1, 0], [7, 0, 0], [2, 5, 9]]
    assert not padded[:, 3:].any()


def test_decode_rows_pending_inputs_and_mixed_layout():
    p = SamplingParams()
    a = Sequence(0, "a", [5, 6, 7], p)
    a.token_ids.append(PENDING_TOKEN)  # sampled by the step in flight
    a.block_table, a.num_computed_tokens = [4], 3
    b = Sequence(1, "b", [8, 9], p)
    b.token_ids.append(11)
    b.block_table, b.num_computed_tokens = [2], 2
    c = Sequence(2, "c", list(range(20, 40)), p)  # a 20-token prompt chunk
    c.block_table = [0, 1]
    scheduled = [
        ScheduledSequence(a, 1, 3, True),
        ScheduledSequence(b, 1, 2, True),
        ScheduledSequence(c, 20, 0, True),
    ]
    step = build_step_inputs(scheduled, block_size=16)
    assert step.num_decode_rows == 2
    assert step.input_ids[:2] == [PENDING_TOKEN, 11] and step.input_ids[2:] == list(range(20, 40))
    assert step.pending_rows == [0] and step.pending_seqs == [a]
    assert step.slot_mapping[:2] == [4 * 16 + 3, 2 * 16 + 2]
    assert step.slot_mapping[2:] == list(range(0, 16)) + list(range(16, 20))
    assert step.cu_seqlens_q == [0, 1, 2, 22] and step.seq_lens == [4, 3, 20]
    assert step.sample_rows == [0, 1, 21]
