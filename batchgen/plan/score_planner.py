"""Score planner: render, tokenize and check each unit's prompt and candidates into score requests.

A unit is one input row (list layout: its candidates column) or one group of rows (group
layout: one candidate per row). Bad candidates become error records; the unit's other
candidates are still scored. Requests are ordered like generate requests (shared prompt
prefix first, then longest first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.request_checks import ModelLimits, check_token_ids
from batchgen.io.rows import InputRow
from batchgen.io.score_reader import MEMBERS_KEY
from batchgen.io.score_rows import ScoreRow
from batchgen.job.spec import ScoreSpec
from batchgen.outputs import RequestOutput
from batchgen.plan.planner import TokenizerLike, encode_in_batches, order_requests, with_source
from batchgen.plan.prompts import PromptError, PromptRenderer
from batchgen.plan.scoring import tokenize_for_scoring

_MISSING = object()  # group layout: the candidate column is absent from a row


@dataclass
class Candidate:
    index: int  # position within its unit
    value: Any  # as read; usable only when a non-empty string
    source: str  # "file:line" for messages
    passthrough: dict[str, Any]

    @property
    def text(self) -> str | None:
        if self.value is None or self.value is _MISSING:
            return None
        return self.value if isinstance(self.value, str) else str(self.value)


@dataclass
class ScoreRequest:
    """One engine score request: a unit's prompt and its candidates that passed the checks."""

    index: int
    id: str
    prompt_token_ids: list[int]
    candidates: list[Candidate]
    token_ids: dict[int, list[int]]  # candidate index -> token ids sent, in candidate order
    errors: list[ScoreRow] = field(default_factory=list)  # candidates refused before the engine


@dataclass
class ScorePlan:
    requests: list[ScoreRequest]  # in the order to feed the engine
    errors: list[ScoreRow]


class _Encoder:
    """The tokenizer tokenize_for_scoring sees: texts pre-encoded in one batch.

    "With special tokens" means "as the prompt": False when a chat template wrote BOS itself,
    so no second BOS is added (the prompt is tokenized as in generate mode).
    """

    def __init__(self, tokenizer: TokenizerLike, texts: list[str], special: bool):
        self.tokenizer = tokenizer
        self.special = special
        unique = list(dict.fromkeys(texts))
        self.cache = dict(zip(unique, encode_in_batches(tokenizer, unique, special)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        special = self.special and add_special_tokens
        if special == self.special and text in self.cache:
            return list(self.cache[text])
        return list(self.tokenizer.encode_batch([text], special)[0])


class ScorePlanner:
    """Turns units into a ScorePlan for one score job.

    Args:
        renderer: renders prompts (template or chat).
        tokenizer: anything with encode_batch(texts, add_special_tokens).
        limits: the model's max_model_len (prompt + candidate) and vocabulary (the engine's
            own id check, request_checks.py, so validate predicts it).
        spec: the job's `score:` section.
        passthrough: input columns copied to the output (per row in the group layout).
    """

    def __init__(
        self,
        renderer: PromptRenderer,
        tokenizer: TokenizerLike,
        limits: ModelLimits,
        spec: ScoreSpec,
        passthrough: tuple[str, ...] = (),
    ):
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.limits = limits
        self.spec = spec
        self.passthrough = passthrough

    def plan(self, units: list[InputRow]) -> ScorePlan:
        """Raises RenderStopped if the renderer's stop turns true while chat templates run."""
        errors: list[ScoreRow] = []
        pending = []
        for unit in units:
            cands, problem = self._candidates(unit)
            if unit.error_code is not None:
                errors += self._fail(unit, cands, unit.error_code, unit.error or "", prefixed=True)
                continue
            if problem is not None:
                errors += self._fail(unit, None, *problem)
                continue
            pending.append((unit, cands))
        staged = []
        # One call renders every unit's prompt (chat templates: one batch to the worker).
        prompts = self.renderer.render_rows([unit.data or {} for unit, _ in pending])
        for (unit, cands), prompt in zip(pending, prompts):
            if isinstance(prompt, PromptError):
                errors += self._fail(unit, cands, prompt.code, str(prompt))
                continue
            staged.append((unit, cands, prompt))
        encoders = {}
        for special in (True, False):
            texts = []
            for _, cands, prompt in staged:
                if prompt.add_special_tokens is special:
                    texts.append(prompt.text)
                    sep = prompt.text + self.spec.separator
                    texts += [sep + c.value for c in cands if _usable(c)]
            encoders[special] = _Encoder(self.tokenizer, texts, special)
        requests = []
        for unit, cands, prompt in staged:
            req = self._request(unit, cands, prompt.text, encoders[prompt.add_special_tokens])
            if req.token_ids:
                requests.append(req)
            else:
                errors += req.errors
        return ScorePlan(order_requests(requests), errors)  # type: ignore[arg-type]

    def _request(self, unit: InputRow, cands: list[Candidate], text: str, enc) -> ScoreRequest:
        good = [c for c in cands if _usable(c)]
        prompt_ids, ids = tokenize_for_scoring(
            enc, text, [c.value for c in good], self.spec.separator
        )
        req = ScoreRequest(unit.index, unit.id or "", prompt_ids, cands, {})
        n = len(prompt_ids)
        vocab = self.limits.vocab_size
        bad_prompt = check_token_ids(prompt_ids, vocab, "prompt")
        checked: dict[int, tuple[str, str] | list[int]] = {}
        for c in cands:
            checked[c.index] = _value_problem(c, self.spec)
        for c, toks in zip(good, ids):
            bad_ids = bad_prompt or check_token_ids(toks, vocab, f"candidate {c.index}")
            if not prompt_ids or text == "":
                checked[c.index] = ("empty_prompt", "prompt is empty")
            elif not toks:
                checked[c.index] = ("empty_candidate", f"candidate {c.index} has no tokens")
            elif bad_ids is not None:  # ids past config.json's vocab_size: the engine's error
                checked[c.index] = (bad_ids.code, bad_ids.message)
            elif n + len(toks) > self.limits.max_model_len:
                checked[c.index] = (
                    "prompt_too_long",
                    f"prompt ({n} tokens) + candidate {c.index} ({len(toks)} tokens) = "
                    f"{n + len(toks)} tokens; the model takes at most {self.limits.max_model_len}, "
                    "shorten the input",
                )
            else:
                checked[c.index] = toks
        for c in cands:
            got = checked[c.index]
            if isinstance(got, list):
                req.token_ids[c.index] = got
            else:
                req.errors.append(_row(unit, c, error=f"{c.source}: {got[1]}", error_code=got[0]))
                req.errors[-1].num_prompt_tokens = n
        return req

    def _candidates(self, unit: InputRow) -> tuple[list[Candidate] | None, tuple | None]:
        data = unit.data
        if data is None:
            return None, None
        if self.spec.grouped:
            col = self.spec.candidate_column
            members = data.get(MEMBERS_KEY) or [(unit.source, data)]
            return [
                Candidate(i, d.get(col, _MISSING), src, self._keep(d))
                for i, (src, d) in enumerate(members)
            ], None
        col = self.spec.candidates_column
        if col not in data:
            return None, ("missing_column", f"column {col!r} is missing from this row")
        values = data[col]
        if values is None:
            return None, ("missing_candidates", f"column {col!r} is null")
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
            kind = type(values).__name__
            return None, ("bad_candidates", f"column {col!r} is {kind}, expected a list of strings")
        values = list(values)
        if not values:
            return None, ("missing_candidates", f"column {col!r} is an empty list")
        keep = self._keep(data)
        return [Candidate(i, v, unit.source, keep) for i, v in enumerate(values)], None

    def _keep(self, data: dict[str, Any]) -> dict[str, Any]:
        return {c: data.get(c) for c in self.passthrough}

    def _fail(self, unit, cands, code: str, message: str, prefixed: bool = False) -> list[ScoreRow]:
        """Error records for a whole unit: one per candidate when they are known."""
        if cands is None:
            msg = message if prefixed else f"{unit.source}: {message}"
            keep = self._keep(unit.data or {})
            return [ScoreRow(unit.index, unit.id, passthrough=keep, error=msg, error_code=code)]
        return [
            _row(unit, c, error=message if prefixed else f"{c.source}: {message}", error_code=code)
            for c in cands
        ]


def _usable(c: Candidate) -> bool:
    return isinstance(c.value, str) and c.value != ""


def _value_problem(c: Candidate, spec: ScoreSpec) -> tuple[str, str]:
    """Why a candidate cannot be tokenized (the code of an unusable candidate)."""
    if c.value is _MISSING:
        return "missing_column", f"column {spec.candidate_column!r} is missing from this row"
    if c.value is None:
        return "null_candidate", f"candidate {c.index} is null"
    if not isinstance(c.value, str):
        return "bad_candidate", f"candidate {c.index} is {type(c.value).__name__}, not a string"
    return "empty_candidate", f"candidate {c.index} is empty"


def _row(unit: InputRow, c: Candidate, **kw) -> ScoreRow:
    return ScoreRow(unit.index, unit.id, c.index, c.text, c.passthrough, **kw)


def to_score_rows(req: ScoreRequest, out: RequestOutput) -> list[ScoreRow]:
    """The output rows of a finished score request, in candidate order, ranked by score."""
    by_index = {c.index: c for c in req.candidates}
    sent = list(req.token_ids)
    base = dict(
        num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=out.num_cached_tokens
    )
    rows = list(req.errors)
    scores = out.scores if out.scores is not None and len(out.scores) == len(sent) else None
    for pos, i in enumerate(sent):
        c = by_index[i]
        s = scores[pos] if scores is not None else None
        if s is None or s.error_code is not None or s.error is not None:
            if s is not None:  # this candidate's own error
                message = _renumbered(s.error or "the engine returned no score", pos, c.index)
            else:  # the whole request's (or no scores at all)
                message = out.error or "the engine returned no score"
            code = (s if s is not None else out).error_code or "engine_error"
            error = with_source(c.source, message)
            rows.append(_unit_row(req, c, base, error=error, error_code=code))
            continue
        rows.append(
            _unit_row(
                req,
                c,
                base,
                score=s.score,
                num_tokens=s.num_tokens,
                mean=s.mean,
                greedy_match=s.greedy_match,
                token_logprobs=s.token_logprobs,
            )
        )
    ok = sorted((r for r in rows if r.ok), key=lambda r: (-r.score, r.candidate_index))
    for rank, r in enumerate(ok, start=1):
        r.rank = rank
    return sorted(rows, key=lambda r: r.candidate_index)


def _renumbered(message: str, sent: int, index: int) -> str:
    """The engine names a candidate by its position among those sent ("candidate 1: ..."), which
    is not its index in the row once an earlier candidate was refused before the engine (row
    candidates [a, "", b] send [a, b]): name the row's candidate_index instead."""
    name = f"candidate {sent}"
    if sent != index and message.startswith(name) and message[len(name) : len(name) + 1] in ": ":
        return f"candidate {index}{message[len(name) :]}"
    return message


def _unit_row(req: ScoreRequest, c: Candidate, base: dict, **kw) -> ScoreRow:
    return ScoreRow(req.index, req.id, c.index, c.text, c.passthrough, **base, **kw)
