"""The standard benchmark workloads (examples/benchmarks/README.md) as token-id requests, seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("nano", "shared-prefix", "summarize", "score", "pipeline", "single-stream")
TEMPERATURE = 0.6
_NANO_TOKEN_MAX = 10000  # nano-vllm draws randint(0, 10000)


@dataclass(frozen=True)
class Workload:
    """Requests of one benchmark run (token ids only; every id is < the model's vocab).

    Attributes:
        prompts: prompt token ids per request.
        max_tokens: output length per request (ignore_eos, so exact); empty for `score`.
        candidates: `score` only: per request, the candidate continuations to score.
        shared_prefix_lens: per request, how many leading prompt tokens an earlier request
            already has (the ideal prefix reuse; 0 when nothing is shared).
    """

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    candidates: list[list[list[int]]] | None = None
    shared_prefix_lens: list[int] = field(default_factory=list)
    temperature: float = TEMPERATURE

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def is_score(self) -> bool:
        return self.candidates is not None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def num_candidate_tokens(self) -> int:
        return sum(len(c) for cands in self.candidates or [] for c in cands)

    @property
    def num_shared_tokens(self) -> int:
        """Prompt tokens an ideal prefix cache serves from cache."""
        return sum(self.shared_prefix_lens)

    def max_request_len(self) -> int:
        """Longest prompt + output (or prompt + candidate) of any request."""
        if self.candidates is not None:
            return max(len(p) + max(map(len, c)) for p, c in zip(self.prompts, self.candidates))
        return max(len(p) + m for p, m in zip(self.prompts, self.max_tokens))

    def capped(self, max_output_tokens: int | None) -> Workload:
        """The same requests with every output length capped (CPU smoke runs)."""
        if max_output_tokens is None:
            return self
        capped = [min(m, max_output_tokens) for m in self.max_tokens]
        return Workload(
            self.name,
            self.prompts,
            capped,
            self.candidates,
            self.shared_prefix_lens,
            self.temperature,
        )

    def part(self, index: int, count: int) -> Workload:
        """Requests index, index + count, ... (one GPU's share of a data parallel run). An
        ideal prefix cache's reuse is counted against the previous request of the share (the
        shared-prefix groups are consecutive); a workload sharing nothing keeps its zeros."""
        prompts = self.prompts[index::count]
        shared = [0] * len(prompts)
        if any(self.shared_prefix_lens):
            shared = [_common_prefix(a, b) for a, b in zip([[]] + prompts, prompts)]
        return Workload(
            self.name,
            prompts,
            self.max_tokens[index::count],
            None if self.candidates is None else self.candidates[index::count],
            shared,
            self.temperature,
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def nano(num_prompts: int = 256, vocab_size: int = 151936) -> Workload:
    """nano-vllm's bench.py stream: all prompts (length, then its tokens) first, then all
    output lengths. With 256 prompts: 142,827 prompt and 133,966 output tokens. Ids are taken
    modulo a vocabulary smaller than 10,001 (the `tiny` preset) so the stream is unchanged."""
    rng = random.Random(0)
    prompts = [
        [rng.randint(0, _NANO_TOKEN_MAX) for _ in range(rng.randint(100, 1024))]
        for _ in range(num_prompts)
    ]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_prompts)]
    if vocab_size <= _NANO_TOKEN_MAX:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return Workload("nano", prompts, max_tokens, shared_prefix_lens=[0] * num_prompts)


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    high = min(vocab_size, _NANO_TOKEN_MAX + 1) - 1
    return [rng.randint(0, high) for _ in range(n)]


def shared_prefix(num_prompts: int = 1024, vocab_size: int = 151936) -> Workload:
    """Groups of 16 prompts (fewer when scaled below 16): a 2048-token system prompt per group
    and a 128-token question per prompt; 256 output tokens. 1024 prompts = 64 groups."""
    per_group = min(16, num_prompts)
    num_groups = max(1, num_prompts // per_group)
    rng = random.Random(1)
    prompts, shared = [], []
    for _ in range(num_groups):
        system = _ids(rng, 2048, vocab_size)
        for j in range(per_group):
            prompts.append(system + _ids(rng, 128, vocab_size))
            shared.append(len(system) if j else 0)
    return Workload("shared-prefix", prompts, [256] * len(prompts), shared_prefix_lens=shared)


def summarize(num_prompts: int = 1000, vocab_size: int = 151936) -> Workload:
    """Prefill-bound: prompts of randint(1500, 2500) tokens, 128 output tokens each."""
    rng = random.Random(2)
    prompts = [_ids(rng, rng.randint(1500, 2500), vocab_size) for _ in range(num_prompts)]
    return Workload("summarize", prompts, [128] * num_prompts, shared_prefix_lens=[0] * num_prompts)


def score(num_prompts: int = 256, vocab_size: int = 151936) -> Workload:
    """512-token prompts, each with 16 candidates of randint(8, 64) tokens to score."""
    rng = random.Random(3)
    prompts, candidates = [], []
    for _ in range(num_prompts):
        prompts.append(_ids(rng, 512, vocab_size))
        candidates.append([_ids(rng, rng.randint(8, 64), vocab_size) for _ in range(16)])
    return Workload("score", prompts, [], candidates, [0] * num_prompts)


def pipeline(num_prompts: int = 20000, vocab_size: int = 151936) -> Workload:
    """The nano recipe's lengths (and stream) extended to 20,000 rows."""
    w = nano(num_prompts, vocab_size)
    return Workload("pipeline", w.prompts, w.max_tokens, shared_prefix_lens=w.shared_prefix_lens)


def single_stream(num_prompts: int = 1, vocab_size: int = 151936) -> Workload:
    """One request (num_prompts of them side by side when scaled): a 128-token prompt and 512
    output tokens. Its decode steps read every weight for one token each: the speed of one
    stream, bound by memory bandwidth."""
    rng = random.Random(4)
    prompts = [_ids(rng, 128, vocab_size) for _ in range(num_prompts)]
    return Workload(
        "single-stream", prompts, [512] * num_prompts, shared_prefix_lens=[0] * num_prompts
    )


_BUILDERS = {
    "nano": nano,
    "shared-prefix": shared_prefix,
    "summarize": summarize,
    "score": score,
    "pipeline": pipeline,
    "single-stream": single_stream,
}


def build_workload(
    name: str,
    vocab_size: int,
    num_prompts: int | None = None,
    max_output_tokens: int | None = None,
) -> Workload:
    """Workload `name` for a model of `vocab_size`.

    Args:
        num_prompts: scale the request count (each prompt keeps its length recipe).
        max_output_tokens: cap every output length (smoke runs); None keeps the recipe's.
    """
    if name not in _BUILDERS:
        raise ValueError(f"workload {name!r}: expected one of {', '.join(WORKLOADS)}")
    builder = _BUILDERS[name]
    w = builder(vocab_size=vocab_size) if num_prompts is None else builder(num_prompts, vocab_size)
    return w.capped(max_output_tokens)


def warmup_workload(
    workload: Workload, vocab_size: int, count: int = 4, min_prompt_tokens: int = 0
) -> Workload:
    """A few requests shaped like the workload's first ones but with other token ids, so the
    timed run finds nothing of them in the prefix cache; outputs capped at 16 tokens.

    count requests, or more until their prompts hold min_prompt_tokens: given the engine's step
    budget, the warm-up's first step is then as large as the timed run's, so the run does not
    meet that step's activation sizes for the first time (the allocator has them cached).
    """
    rng = random.Random(12345)
    k = min(count, workload.num_requests)
    held = sum(len(p) for p in workload.prompts[:k])
    while k < workload.num_requests and held < min_prompt_tokens:
        held += len(workload.prompts[k])
        k += 1
    prompts = [_ids(rng, len(p), vocab_size) for p in workload.prompts[:k]]
    candidates = None
    if workload.candidates is not None:
        candidates = [[_ids(rng, len(c), vocab_size) for c in cs] for cs in workload.candidates[:k]]
    max_tokens = [min(m, 16) for m in workload.max_tokens[:k]]
    return Workload("warmup", prompts, max_tokens, candidates, [0] * k, workload.temperature)
