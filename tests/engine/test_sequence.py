"""Sequence: token bookkeeping and derived counts."""

import pytest

from batchgen.engine.sequence import Sequence, SequenceStatus
from batchgen.sampling_params import SamplingParams


def test_fresh_sequence_counts():
    seq = Sequence(7, "r", [1, 2, 3], SamplingParams(max_tokens=4), sample_index=2, seed=9)
    assert seq.status is SequenceStatus.WAITING
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    assert seq.block_table == [] and seq.finish_reason is None
    assert seq.sample_index == 2 and seq.seed == 9
    assert not seq.is_score and not seq.is_finished
    assert seq.max_output_tokens == 4 and seq.max_kv_tokens == 3 + 4 - 1


def test_append_token_and_views():
    prompt = [1, 2, 3]
    seq = Sequence(0, "r", prompt, SamplingParams())
    seq.append_token(10)
    seq.append_token(11)
    assert seq.token_ids == [1, 2, 3, 10, 11]
    assert seq.prompt_token_ids == [1, 2, 3] and seq.output_token_ids == [10, 11]
    assert seq.last_token_id == 11 and seq.num_output_tokens == 2
    assert prompt == [1, 2, 3]  # the caller's list is copied, not aliased
    assert seq.num_blocks(4) == 2 and seq.num_blocks(5) == 1


def test_score_sequence():
    seq = Sequence(0, "r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50), score_from=3)
    assert seq.is_score and seq.max_output_tokens == 0 and seq.max_kv_tokens == 5
    with pytest.raises(AssertionError):
        seq.append_token(1)


@pytest.mark.parametrize("score_from", [0, 5, 9])
def test_score_from_out_of_range(score_from):
    with pytest.raises(ValueError, match="score_from"):
        Sequence(0, "r", [1, 2, 3, 4, 5], SamplingParams(), score_from=score_from)


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence(0, "r", [], SamplingParams())
