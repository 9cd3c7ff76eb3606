"""How a decoder's dimensions split across tensor-parallel ranks, and the sizes that cannot split.

Column-parallel projections (q/k/v, gate/up, the vocabulary of the embedding and LM head) keep
a contiguous block of output rows per rank; row-parallel ones (o, down) keep the matching block
of input columns. Attention heads are never cut: rank r holds query heads [r * Hq / N, (r + 1)
* Hq / N). KV heads split the same way when there are at least N of them; with fewer, N must be
a multiple of their count and each rank holds the one KV head its query heads read (heads
replicated N / Hk times), so GQA groups stay whole on every rank.

Mixtures of experts (a config with `moe`) split every expert the way the dense MLP splits:
rank r holds the same block of each expert's intermediate rows (gate / up rows, down columns),
so every rank runs every expert on its slice; the router is whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.config import ConfigError

# Tensor parallel sizes offered in error messages (the divisors of the model's sizes up to here).
_MAX_SUGGESTED = 64


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, start + length) of a full dimension of `full` rows (a rank's block)."""

    start: int
    length: int
    full: int


@dataclass(frozen=True)
class Partition:
    """One rank's share of a model of the given sizes (rank 0 of 1 holds everything).

    Attributes:
        rank, size: this rank and the number of ranks.
        num_heads / num_kv_heads: query / KV heads this rank computes.
        kv_head_start: the first (global) KV head this rank holds.
        intermediate_size: MLP columns this rank computes.
        vocab_start / vocab_size: the vocabulary rows of the embedding and LM head it holds.
        expert_intermediate_size: each expert's intermediate rows this rank computes (0 for a
            model without experts).
    """

    rank: int
    size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_start: int
    vocab_size: int
    total_heads: int
    total_kv_heads: int
    total_intermediate: int
    total_vocab: int
    expert_intermediate_size: int = 0
    total_expert_intermediate: int = 0

    @classmethod
    def of(cls, config, rank: int = 0, size: int = 1) -> Partition:
        """Rank `rank` of `size` for a ModelConfig-like `config` (num_attention_heads,
        num_key_value_heads, head_dim, intermediate_size, vocab_size, and optionally moe with
        its intermediate_size).

        Raises:
            ConfigError: `size` does not divide the model (check_divides).
        """
        check_divides(config, size)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if kv >= size:
            local_kv, kv_start = kv // size, rank * (kv // size)
        else:  # each KV head serves size // kv consecutive ranks
            local_kv, kv_start = 1, rank // (size // kv)
        inter, vocab = config.intermediate_size // size, config.vocab_size // size
        moe = getattr(config, "moe", None)
        expert_inter = moe.intermediate_size if moe is not None else 0
        return cls(
            rank=rank,
            size=size,
            head_dim=config.head_dim,
            num_heads=heads // size,
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate_size=inter,
            vocab_start=rank * vocab,
            vocab_size=vocab,
            total_heads=heads,
            total_kv_heads=kv,
            total_intermediate=config.intermediate_size,
            total_vocab=config.vocab_size,
            expert_intermediate_size=expert_inter // size,
            total_expert_intermediate=expert_inter,
        )

    def q_rows(self) -> RowBlock:
        """This rank's rows of q_proj (and columns of o_proj)."""
        d = self.head_dim
        return RowBlock(self.rank * self.num_heads * d, self.num_heads * d, self.total_heads * d)

    def kv_rows(self) -> RowBlock:
        """This rank's rows of k_proj and of v_proj."""
        d = self.head_dim
        return RowBlock(self.kv_head_start * d, self.num_kv_heads * d, self.total_kv_heads * d)

    def intermediate_rows(self) -> RowBlock:
        """This rank's rows of gate_proj and up_proj (and columns of down_proj)."""
        n = self.intermediate_size
        return RowBlock(self.rank * n, n, self.total_intermediate)

    def expert_rows(self) -> RowBlock:
        """This rank's rows of each expert's gate and up projections (and columns of its down
        projection)."""
        n = self.expert_intermediate_size
        return RowBlock(self.rank * n, n, self.total_expert_intermediate)

    def vocab_rows(self) -> RowBlock:
        """This rank's rows of embed_tokens and lm_head."""
        return RowBlock(self.vocab_start, self.vocab_size, self.total_vocab)


def _divisors_of_all(values: list[int]) -> list[int]:
    return [n for n in range(1, _MAX_SUGGESTED + 1) if all(v % n == 0 for v in values)]


def check_divides(config, size: int) -> None:
    """Raise ConfigError, naming the config.json key, unless `size` ranks can split the model:
    it divides the attention heads, the intermediate size (of the dense MLP where a layer has
    one, of each expert where the model has experts) and the vocabulary, and divides or is a
    multiple of the KV heads."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size={size}: must be >= 1")
    if size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    sizes = {"num_attention_heads": heads}
    moe = getattr(config, "moe", None)
    if moe is None or not all(moe.sparse_layers):  # a dense MLP somewhere
        sizes["intermediate_size"] = config.intermediate_size
    if moe is not None:
        sizes[moe.intermediate_key] = moe.intermediate_size
    sizes["vocab_size"] = config.vocab_size
    valid = [
        n
        for n in _divisors_of_all(list(sizes.values()))
        if (kv % n == 0 if kv >= n else n % kv == 0)
    ]
    hint = f"; sizes that split this model: {', '.join(map(str, valid))}"
    for key, value in sizes.items():
        if value % size:
            raise ConfigError(
                f"tensor_parallel_size={size} does not divide the model's {key}={value} "
                f"(config.json){hint}"
            )
    if (kv % size if kv >= size else size % kv) != 0:
        raise ConfigError(
            f"tensor_parallel_size={size} and the model's num_key_value_heads={kv} "
            "(config.json): the KV heads must split evenly across the ranks, or the ranks evenly "
            f"across the KV heads{hint}"
        )


def check_gpu_count(size: int, first_index: int, visible: int) -> None:
    """Raise ConfigError unless GPUs first_index .. first_index + size - 1 are visible."""
    if first_index + size > visible:
        start = f"cuda:{first_index}" if first_index else "cuda:0"
        raise ConfigError(
            f"tensor_parallel_size={size} needs {size} GPUs from {start} on, but torch sees "
            f"{visible} (CUDA_VISIBLE_DEVICES chooses which); lower tensor_parallel_size or "
            "make more GPUs visible"
        )
