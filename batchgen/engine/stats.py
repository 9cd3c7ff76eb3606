"""EngineStats: running counters of one engine, for callers, progress bars and benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_requests: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (all samples count once)
    num_cached_tokens: int = 0  # of those, served from the prefix cache or a fork
    num_generated_tokens: int = 0
    num_scored_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_errors: int = 0
    start_time: float = field(default_factory=time.perf_counter)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    @property
    def generated_tokens_per_s(self) -> float:
        return self.num_generated_tokens / max(self.elapsed, 1e-9)

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.num_requests,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens,
            "generated_tokens": self.num_generated_tokens,
            "scored_tokens": self.num_scored_tokens,
            "preemptions": self.num_preemptions,
            "steps": self.num_steps,
            "errors": self.num_errors,
            "prefix_cache_hit_rate": round(self.prefix_cache_hit_rate, 4),
            "elapsed_s": round(self.elapsed, 3),
            "generated_tok_per_s": round(self.generated_tokens_per_s, 1),
        }
