"""Request: the engine's state for one request — its sequences and what they produced so far."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from batchgen.engine.detokenizer import StopStringChecker
from batchgen.engine.sequence import Sequence
from batchgen.outputs import CompletionOutput, RequestOutput, ScoreOutput
from batchgen.sampling_params import SamplingParams


def sample_seed(seed: int, sample_index: int) -> int:
    """Independent 63-bit stream keys for the n samples of one request seed."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class ScoreAccumulator:
    """Running log-likelihood of one candidate, reset if its sequence is preempted."""

    logprobs: list[float] = field(default_factory=list)
    all_argmax: bool = True

    def add(self, logprob: float, is_argmax: bool) -> None:
        self.logprobs.append(logprob)
        self.all_argmax = self.all_argmax and is_argmax

    def result(self, with_tokens: bool) -> ScoreOutput:
        total = sum(self.logprobs)
        n = len(self.logprobs)
        return ScoreOutput(
            score=total,
            num_tokens=n,
            mean=total / n,
            token_logprobs=list(self.logprobs) if with_tokens else None,
            greedy_match=self.all_argmax,
        )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    stop_checkers: dict[int, StopStringChecker] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    scores: dict[int, ScoreAccumulator] = field(default_factory=dict)
    score_errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    num_candidates: int = 0  # > 0 marks a score request; seq.sample_index = candidate index
    return_token_logprobs: bool = False
    error: tuple[str, str] | None = None  # (code, message): failed while running

    @property
    def is_score(self) -> bool:
        return self.num_candidates > 0

    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def settled(self) -> bool:
        """No launched step still owes this request tokens or scores."""
        return all(s.num_inflight == 0 for s in self.seqs)

    def output(self, decode, incomplete: dict[int, bool | None] | None = None) -> RequestOutput:
        """The finished request's RequestOutput; `decode(ids) -> str` decodes a sample once.
        `incomplete`: per seq_id, whether a constrained sample's output falls short of its
        structured_outputs constraint."""
        if self.error is not None:
            return RequestOutput.failed(self.request_id, self.prompt_token_ids, *self.error)
        # Prompt tokens served from the cache when the prompt was first computed (for a score
        # request, by its first candidate; the others reuse that prompt by construction).
        first = self.seqs[0] if self.seqs else None
        cached = first.num_cached_tokens if first is not None else 0
        if self.is_score:
            results: list[ScoreOutput] = []
            for i in range(self.num_candidates):
                if i in self.score_errors:
                    code, message = self.score_errors[i]
                    results.append(ScoreOutput(0.0, 0, 0.0, error=message, error_code=code))
                else:
                    results.append(self.scores[i].result(self.return_token_logprobs))
            return RequestOutput(
                self.request_id,
                self.prompt_token_ids,
                [],
                num_cached_tokens=cached,
                scores=results,
            )
        outputs = []
        for seq in sorted(self.seqs, key=lambda s: s.sample_index):
            assert seq.num_known_tokens == seq.num_tokens, f"{seq} still has pending tokens"
            checker = self.stop_checkers.get(seq.seq_id)
            if checker is not None and checker.stop_index is not None:
                text = checker.final_text()
            else:
                text = decode(seq.output_token_ids)
            outputs.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason or "stop",
                    logprobs=self.logprobs.get(seq.seq_id),
                    incomplete=(incomplete or {}).get(seq.seq_id),
                )
            )
        return RequestOutput(
            self.request_id, self.prompt_token_ids, outputs, num_cached_tokens=cached
        )
