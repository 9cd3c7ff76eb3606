"""A deterministic stand-in for LLMEngine and Tokenizer (CPU, no model)."""

from __future__ import annotations

import hashlib
import time

from batchgen.engine.request_checks import ModelLimits
from batchgen.engine.stats import EngineStats
from batchgen.outputs import CompletionOutput, RequestOutput, ScoreOutput
from batchgen.sampling_params import SamplingParams

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class FakeTokenizer:
    """Byte-level: token = byte + 3; BOS = 1, EOS = 2."""

    vocab_size = 259
    bos_token_id = 1
    bos_token = "<s>"
    eos_token = "</s>"
    eos_token_ids = frozenset({2})
    chat_template: str | None = CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def encode_batch(self, texts, add_special_tokens=True):
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


def fake_text(prompt_token_ids: list[int], seed: int | None, index: int = 0, max_tokens=None):
    """What the FakeEngine generates for a prompt: a digest of the prompt, seed and sample."""
    key = f"{prompt_token_ids}|{seed}|{index}".encode()
    text = "gen-" + hashlib.blake2b(key, digest_size=6).hexdigest()
    return text if max_tokens is None else text[:max_tokens]


def fake_logprobs(prompt_token_ids: list[int], candidate_ids: list[int]) -> list[float]:
    """What the FakeEngine scores: a per-token log-prob in (-10, 0) from a digest of the tokens."""
    out = []
    for j in range(len(candidate_ids)):
        key = f"{prompt_token_ids}|{candidate_ids[: j + 1]}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
        out.append(-((h % 997) + 1) / 100.0)
    return out


def fake_score(prompt_token_ids, candidate_ids, with_tokens=False) -> ScoreOutput:
    lps = fake_logprobs(prompt_token_ids, candidate_ids)
    return ScoreOutput(
        sum(lps),
        len(lps),
        sum(lps) / len(lps),
        list(lps) if with_tokens else None,
        greedy_match=all(lp > -1.0 for lp in lps),
    )


class FakeEngine:
    """Finishes each request 1-3 steps after it is added (out of order), `max_num_seqs` at a time.

    Args:
        max_model_len: prompts of this many tokens or more fail with prompt_too_long.
        step_delay: seconds slept per step (to make runs slow enough to interrupt).
    """

    def __init__(self, max_model_len: int = 512, step_delay: float = 0.0, max_num_seqs=64):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.limits = ModelLimits(max_model_len, FakeTokenizer.vocab_size)
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.stats = EngineStats()
        self._waiting: list[tuple[str, list[int], SamplingParams]] = []
        self._running: dict[str, tuple[list[int], SamplingParams, int]] = {}
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.added.append(request_id)
        self._waiting.append((request_id, ids, params))

    def add_score_request(self, request_id, prompt, candidates, return_token_logprobs=False):
        self.added.append(request_id)
        score = ("score", [list(c) for c in candidates], return_token_logprobs)
        self._waiting.append((request_id, list(prompt), score))

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def step(self) -> list[RequestOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        self.stats.num_steps += 1
        while self._waiting and len(self._running) < self.max_num_seqs:
            rid, ids, params = self._waiting.pop(0)
            steps = 1 + int(hashlib.md5(rid.encode()).hexdigest(), 16) % 3
            self._running[rid] = (ids, params, steps)
        done = []
        for rid in list(self._running):
            ids, params, left = self._running[rid]
            if left > 1:
                self._running[rid] = (ids, params, left - 1)
                continue
            del self._running[rid]
            done.append(self._finish(rid, ids, params))
        return done

    def _finish(self, rid: str, ids: list[int], params: SamplingParams) -> RequestOutput:
        if isinstance(params, tuple):
            return self._finish_score(rid, ids, *params[1:])
        if not ids:
            return RequestOutput.failed(rid, ids, "empty_prompt", "prompt is empty")
        if len(ids) >= self.max_model_len:
            return RequestOutput.failed(rid, ids, "prompt_too_long", "prompt too long")
        outs = []
        for i in range(params.n):
            full = self.tokenizer.encode(fake_text(ids, params.seed, i), add_special_tokens=False)
            toks = full[: params.max_tokens]
            text = self.tokenizer.decode(toks)
            reason = "length" if len(toks) == params.max_tokens else "stop"
            outs.append(CompletionOutput(i, text, toks, reason))
        self.stats.num_prompt_tokens += len(ids)
        self.stats.num_generated_tokens += sum(len(o.token_ids) for o in outs)
        return RequestOutput(rid, ids, outs)

    def _finish_score(self, rid, ids, candidates, with_tokens) -> RequestOutput:
        if not ids:
            return RequestOutput.failed(rid, ids, "empty_prompt", "prompt is empty")
        scores = []
        for i, cand in enumerate(candidates):
            if not cand:
                scores.append(
                    ScoreOutput(
                        0.0, 0, 0.0, error=f"candidate {i} empty", error_code="empty_candidate"
                    )
                )
            elif len(ids) + len(cand) > self.max_model_len:
                scores.append(
                    ScoreOutput(
                        0.0, 0, 0.0, error=f"candidate {i} too long", error_code="prompt_too_long"
                    )
                )
            else:
                scores.append(fake_score(ids, cand, with_tokens))
        self.stats.num_prompt_tokens += len(ids)
        return RequestOutput(rid, ids, [], scores=scores)
