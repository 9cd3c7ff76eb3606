"""How models split across tensor-parallel ranks: every row owned exactly once (KV heads
replicated when fewer than ranks), and sizes that cannot split refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchgen.config import ConfigError
from batchgen.distributed.partition import Partition, check_divides, check_gpu_count


def config(heads=8, kv=2, inter=64, vocab=128, head_dim=4):
    return SimpleNamespace(
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        head_dim=head_dim,
    )


def rows(block) -> list[int]:
    return list(range(block.start, block.start + block.length))


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_column_blocks_tile_each_dimension_once(size):
    c = config(heads=8, kv=8, inter=64, vocab=128)
    parts = [Partition.of(c, r, size) for r in range(size)]
    for getter, full in (
        (Partition.q_rows, 8 * 4),
        (Partition.kv_rows, 8 * 4),
        (Partition.intermediate_rows, 64),
        (Partition.vocab_rows, 128),
    ):
        owned = [i for p in parts for i in rows(getter(p))]
        assert sorted(owned) == list(range(full))  # each row on exactly one rank
        assert all(getter(p).full == full for p in parts)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_expert_blocks_tile_each_experts_rows_once(size):
    c = config(heads=8, kv=8, inter=64, vocab=128)
    c.moe = SimpleNamespace(intermediate_size=48, sparse_layers=(True, False),
                            intermediate_key="moe_intermediate_size")  # fmt: skip
    parts = [Partition.of(c, r, size) for r in range(size)]
    owned = [i for p in parts for i in rows(p.expert_rows())]
    assert sorted(owned) == list(range(48))
    assert all(p.expert_intermediate_size == 48 // size for p in parts)
    assert all(p.intermediate_size == 64 // size for p in parts)  # the dense layer's


def test_fewer_kv_heads_than_ranks_replicates_the_head_each_group_reads():
    # 8 query heads in 2 GQA groups of 4 (kv heads 0 and 1), over 4 ranks of 2 query heads.
    c = config(heads=8, kv=2)
    parts = [Partition.of(c, r, 4) for r in range(4)]
    assert [p.num_kv_heads for p in parts] == [1, 1, 1, 1]
    for p in parts:
        first_q_head = p.q_rows().start // c.head_dim
        group = first_q_head // (c.num_attention_heads // c.num_key_value_heads)
        assert p.kv_head_start == group
        assert rows(p.kv_rows()) == list(range(group * 4, group * 4 + 4))
    one_kv = [Partition.of(config(heads=4, kv=1), r, 2) for r in range(2)]
    assert [p.kv_head_start for p in one_kv] == [0, 0]


def test_single_rank_holds_everything():
    p = Partition.of(config())
    assert (p.num_heads, p.num_kv_heads, p.intermediate_size, p.vocab_size) == (8, 2, 64, 128)


@pytest.mark.parametrize(
    "kwargs, size, key",
    [
        ({"heads": 6, "kv": 6}, 4, "num_attention_heads=6"),
        ({"inter": 66}, 4, "intermediate_size=66"),
        ({"vocab": 130}, 4, "vocab_size=130"),
        ({"heads": 12, "kv": 3}, 4, "num_key_value_heads=3"),
        ({"heads": 24, "kv": 6}, 4, "num_key_value_heads=6"),
    ],
)
def test_sizes_that_cannot_split_are_refused_by_key(kwargs, size, key):
    with pytest.raises(ConfigError) as e:
        check_divides(config(**kwargs), size)
    message = str(e.value)
    assert f"tensor_parallel_size={size}" in message and key in message
    offered = [int(n) for n in message.split("sizes that split this model: ")[1].split(", ")]
    c = config(**kwargs)
    for n in offered:  # every size offered does split the model
        check_divides(c, n)


def test_gpu_count():
    check_gpu_count(2, 0, 2)
    check_gpu_count(2, 2, 4)
    with pytest.raises(ConfigError, match=r"needs 4 GPUs from cuda:0 on, but torch sees 2"):
        check_gpu_count(4, 0, 2)
    with pytest.raises(ConfigError, match=r"needs 2 GPUs from cuda:3 on, but torch sees 4"):
        check_gpu_count(2, 3, 4)
