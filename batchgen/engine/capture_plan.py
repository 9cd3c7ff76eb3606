"""CapturePlan: what a tensor-parallel rank is about to capture, compared across the ranks first.

Every rank must capture the same CUDA graphs in the same order, each with the same collectives:
a collective replayed from a graph waits on the GPU for its peers beyond the reach of any
timeout, so ranks that captured different graphs (or replay different ones) hang. Each rank
derives its plan from its own state (configuration, agreed KV blocks, its all-reduce routes);
`settle_plan` compares them over the control connections (which cannot hang on a peer in a
collective) before any graph is captured, and every rank raises TensorParallelError naming the
difference if one differs from rank 0's. After capture, `settle_collectives` compares the
collectives each rank actually issued while warming up and capturing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from batchgen.distributed.group import TensorParallelError

# (phase, value, reduce) -> the value settled across the ranks (ModelRunner._agree).
Agree = Callable[[str, Any, Callable[[list], Any]], Any]


@dataclass(frozen=True)
class CapturePlan:
    """One rank's capture plan.

    Attributes:
        graphs: (kind "decode" | "mixed", decode bucket, rows, all-reduce route of its
            [rows, hidden] activations) per graph, in capture order; () when none are captured.
        hidden_size, dtype: the activations the all-reduces carry.
        num_kv_blocks, block_size, max_model_len: the cache and block tables the graphs read.
        chunk_tokens: prompt rows of each mixed graph (0: no mixed graphs).
        one_shot_max_bytes: the largest all-reduce run by the one-shot kernel (0: none).
    """

    graphs: tuple[tuple[str, int, int, str], ...]
    hidden_size: int
    dtype: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    chunk_tokens: int
    one_shot_max_bytes: int

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def plan_graphs(
    decode_sizes: list[int], mixed_sizes: list[int], chunk: int, route: Callable[[int], str]
) -> tuple[tuple[str, int, int, str], ...]:
    """The graphs in the order the runner captures them: DecodeGraphs' buckets, largest first,
    then MixedGraphs' (bucket + chunk rows each). route(rows) names the all-reduce route."""
    graphs = [("decode", bs, bs, route(bs)) for bs in reversed(decode_sizes)]
    graphs += [("mixed", bs, bs + chunk, route(bs + chunk)) for bs in reversed(mixed_sizes)]
    return tuple(graphs)


def _first_difference(a: Any, b: Any) -> str:
    """A short text of where b differs from a (the first differing item of a sequence)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"item {i}: {x} against {y}"
        return f"{len(a)} items against {len(b)}"
    return f"{a} against {b}"


def plan_mismatch(plans: list[CapturePlan]) -> str | None:
    """None if every rank's plan equals rank 0's, else a message naming each differing rank
    and field (rank 0's value first)."""
    parts = []
    for rank, plan in enumerate(plans[1:], start=1):
        for f in fields(CapturePlan):
            a, b = getattr(plans[0], f.name), getattr(plan, f.name)
            if a != b:
                parts.append(f"rank {rank} {f.name}: {_first_difference(a, b)}")
    if not parts:
        return None
    return (
        "tensor parallel ranks planned different CUDA graphs (capturing them would hang); "
        "rank 0's value first: " + "; ".join(parts)
    )


def settle_plan(agree: Agree, plan: CapturePlan) -> None:
    """Compare this rank's plan with every other rank's before any graph is captured.

    Raises:
        TensorParallelError: on every rank, if any rank's plan differs from rank 0's.
    """
    mismatch = agree("capture plan", plan, plan_mismatch)
    if mismatch is not None:
        raise TensorParallelError(mismatch)


def collectives_summary(record: list[tuple[str, str, int]]) -> tuple[int, str, dict[str, int]]:
    """(count, digest of the sequence, count per op and route) of recorded collectives."""
    digest = hashlib.sha256(repr(record).encode()).hexdigest()[:16]
    counts: dict[str, int] = {}
    for op, route, _ in record:
        counts[f"{op}/{route}"] = counts.get(f"{op}/{route}", 0) + 1
    return len(record), digest, counts


def collectives_mismatch(summaries: list[tuple[int, str, dict[str, int]]]) -> str | None:
    """None if every rank issued the same collectives as rank 0, else a message with each
    differing rank's counts."""
    bad = [(rank, s) for rank, s in enumerate(summaries) if s[1] != summaries[0][1]]
    if not bad:
        return None
    text = "; ".join(f"rank {rank}: {s[0]} {s[2]}" for rank, s in [(0, summaries[0])] + bad)
    return f"tensor parallel ranks issued different collectives while capturing graphs: {text}"


def settle_collectives(agree: Agree, record: list[tuple[str, str, int]]) -> None:
    """Compare the collectives this rank issued while capturing with every other rank's.

    Raises:
        TensorParallelError: on every rank, if any rank's sequence differs from rank 0's.
    """
    mismatch = agree("captured", collectives_summary(record), collectives_mismatch)
    if mismatch is not None:
        raise TensorParallelError(mismatch)
