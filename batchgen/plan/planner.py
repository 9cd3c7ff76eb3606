"""Planner: render, tokenize and validate a shard's rows into engine requests plus error records.

It also orders the requests for the engine: rows sharing a prompt prefix are grouped (so
their cached prefix blocks are reused while still resident) and sorted longest-first within
a group (so long prefills start early and short ones fill the gaps).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from batchgen.engine.request_checks import ModelLimits, RequestError, check_request
from batchgen.io.json_line import loads
from batchgen.io.readers import OPENAI_KEY
from batchgen.io.rows import InputRow, ResultRow
from batchgen.outputs import RequestOutput
from batchgen.plan.openai_logprobs import TokenBytes, chat_logprobs, completion_logprobs
from batchgen.plan.openai_request import parse_body
from batchgen.plan.prompts import Conversation, PromptError, PromptRenderer, RenderedPrompt
from batchgen.sampling_params import SamplingParams, SamplingParamsError
from batchgen.structured_outputs import StructuredOutputsParams

# The row error code of a structured_outputs constraint the grammar engine refuses.
BAD_STRUCTURED_OUTPUT = "bad_structured_output"

PREFIX_TOKENS = 32  # rows whose first 32 prompt tokens agree form one prefix group
# Characters per tokenizer call: tokenizing holds about 170 bytes per character at its peak
# (encodings with offsets, masks and type ids), so 4 Mi characters peak near 0.7 GB, however
# many rows a shard has (1,024 rows just under input.max_row_bytes would be 4 GiB at once).
TOKENIZE_BATCH_CHARS = 4 << 20
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


class TokenizerLike(Protocol):
    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]: ...


@dataclass
class Request:
    """One engine request for one input row."""

    index: int
    id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    passthrough: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    source: str = ""  # the row's file:line, which an engine error message names


@dataclass
class _Params:
    """A row's SamplingParams and where each given field was set: "sampling" (the job), "body"
    (an OpenAI batch line) or the overrides column's name."""

    params: SamplingParams
    origin: dict[str, str]


@dataclass
class _Staged:
    """A row on its way through plan(): its prompt is text, token ids, a conversation still
    to render, or None once it failed."""

    row: InputRow
    keep: dict[str, Any]  # passthrough values
    prompt: RenderedPrompt | Conversation | list[int] | None
    params: _Params
    chat: bool


@dataclass
class Plan:
    requests: list[Request]  # in the order to feed the engine
    errors: list[ResultRow]


def row_seed(base_seed: int | None, row_id: str) -> int:
    """A stable 63-bit seed from (job seed, row id): independent of batch, order, shard, resume."""
    h = hashlib.blake2b(f"{base_seed or 0}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class Planner:
    """Turns InputRows into a Plan for one job.

    Args:
        renderer: renders prompts (template or chat).
        tokenizer: anything with encode_batch(texts, add_special_tokens).
        limits: the model's max_model_len and vocabulary; every row is checked against them
            with the engine's own checks (request_checks.py), so a row the engine would refuse
            is an error record here, in `batchgen run` and in `batchgen validate` alike.
        base_params: the job's `sampling:` fields.
        passthrough: input columns copied to the output.
        overrides_column: optional column of per-row sampling overrides (dict or JSON text).
        allow_multi: rows may ask for n > 1 (the output has the list layout).
        structured_check: constraint -> why the grammar engine refuses it, or None; a row
            whose structured_outputs it refuses is a bad_structured_output error record. In a
            run it is the engine's compiler, so planning a shard compiles its rows' new
            constraints before they reach the engine.
    """

    def __init__(
        self,
        renderer: PromptRenderer,
        tokenizer: TokenizerLike,
        limits: ModelLimits,
        base_params: dict[str, Any],
        passthrough: tuple[str, ...] = (),
        overrides_column: str | None = None,
        allow_multi: bool = True,
        structured_check: Callable[[StructuredOutputsParams], str | None] | None = None,
    ):
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.limits = limits
        self.base_params = dict(base_params)
        self.passthrough = passthrough
        self.overrides_column = overrides_column
        self.allow_multi = allow_multi
        self.structured_check = structured_check

    def plan(self, rows: list[InputRow]) -> Plan:
        """Raises RenderStopped if the renderer's stop turns true while chat templates run."""
        errors: list[ResultRow] = []
        staged: list[_Staged] = []
        for row in rows:
            keep = self._passthrough(row)
            if row.error_code is not None:
                errors.append(
                    ResultRow(row.index, row.id, keep, error=row.error, error_code=row.error_code)
                )
                continue
            try:
                prompt, chat, extra = self._prompt(row)
                params = self._params(row, extra)
            except PromptError as e:
                errors.append(ResultRow.failed(row, e.code, str(e), keep))
                continue
            staged.append(_Staged(row, keep, prompt, params, chat))
        # Every chat conversation of the shard goes to the template worker in one call.
        chats = [s for s in staged if isinstance(s.prompt, Conversation)]
        rendered = self.renderer.render_conversations([s.prompt.messages for s in chats])
        for s, result in zip(chats, rendered):
            if isinstance(result, PromptError):
                errors.append(ResultRow.failed(s.row, result.code, str(result), s.keep))
                s.prompt = None
            else:
                s.prompt = result
        staged = [s for s in staged if s.prompt is not None]
        token_ids = self._tokenize([s.prompt for s in staged])
        requests = []
        for s, ids in zip(staged, token_ids):
            row, keep, prompt, params = s.row, s.keep, s.prompt, s.params
            if not ids or (isinstance(prompt, RenderedPrompt) and prompt.text == ""):
                errors.append(ResultRow.failed(row, "empty_prompt", "prompt is empty", keep))
                continue
            error = check_request(ids, params.params, self.limits) or self._check_structured(params)
            if error is not None:
                message = error.message
                if error.field is not None:  # say where the field was set: job, body or row
                    message = f"{params.origin.get(error.field, 'sampling')}.{message}"
                n = len(ids) if error.code == "prompt_too_long" else 0
                errors.append(ResultRow.failed(row, error.code, message, keep, n))
            else:
                requests.append(
                    Request(row.index, row.id, ids, params.params, keep, s.chat, row.source)
                )
        return Plan(order_requests(requests), errors)

    def _check_structured(self, params: _Params) -> RequestError | None:
        """The row's constraint against the grammar engine (a refusal names where it was set:
        params.structured_outputs.json: ..., sampling.structured_outputs...)."""
        constraint = params.params.structured_outputs
        if constraint is None or self.structured_check is None:
            return None
        refused = self.structured_check(constraint)
        if refused is None:
            return None
        return RequestError(BAD_STRUCTURED_OUTPUT, refused, "structured_outputs")

    def _passthrough(self, row: InputRow) -> dict[str, Any]:
        data = row.data or {}
        return {c: data.get(c) for c in self.passthrough}

    def _prompt(
        self, row: InputRow
    ) -> tuple[RenderedPrompt | Conversation | list[int], bool, dict]:
        """The row's prompt: text, token ids, or a conversation for the chat template."""
        openai = (row.data or {}).get(OPENAI_KEY)
        if openai is None:
            return self.renderer.prepare(row.data or {}), self.renderer.spec.chat is not None, {}
        request = parse_body(openai["url"], openai["body"])  # every field honoured or refused
        if request.chat:
            return Conversation(request.messages), True, request.params
        if isinstance(request.prompt, str):
            return RenderedPrompt(request.prompt, add_special_tokens=True), False, request.params
        return request.prompt, False, request.params

    def _params(self, row: InputRow, extra: dict[str, Any]) -> _Params:
        kw = dict(self.base_params)
        origin = dict.fromkeys(kw, "sampling")
        kw.update(extra)
        origin.update(dict.fromkeys(extra, "body"))
        if self.overrides_column:
            overrides = self._overrides(row)
            kw.update(overrides)
            origin.update(dict.fromkeys(overrides, self.overrides_column))
        if origin.get("seed") in (None, "sampling"):  # a seed the row gives is used as is
            kw["seed"] = row_seed(self.base_params.get("seed"), row.id or "")
        try:
            params = SamplingParams(**kw)
        except (SamplingParamsError, TypeError) as e:
            message = str(e)
            where = origin.get(getattr(e, "field", None) or "")
            if where is not None:  # "SamplingParams.n=..." -> "params.n=..." (the row's key)
                message = message.replace("SamplingParams.", f"{where}.", 1)
            raise PromptError("bad_params", message) from None
        if params.n > 1 and not self.allow_multi:
            raise PromptError(
                "bad_params",
                f"n={params.n} for one row needs sampling.n > 1 in "
                "the job (which makes text a list column)",
            )
        return _Params(params, origin)

    def _overrides(self, row: InputRow) -> dict[str, Any]:
        value = (row.data or {}).get(self.overrides_column)
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                value = loads(value)  # ValueError also for deep nesting, lone surrogates
            except ValueError as e:
                raise PromptError(
                    "bad_params", f"{self.overrides_column}: not JSON ({e})"
                ) from None
        if not isinstance(value, dict):
            raise PromptError("bad_params", f"{self.overrides_column}: expected an object")
        value = {k: v for k, v in value.items() if v is not None}
        unknown = sorted(set(value) - _PARAM_NAMES)
        if unknown:
            raise PromptError("bad_params", f"{self.overrides_column}: unknown field(s) {unknown}")
        return value

    def _tokenize(self, prompts: list[RenderedPrompt | list[int]]) -> list[list[int]]:
        out: list[list[int] | None] = [p if isinstance(p, list) else None for p in prompts]
        for flag in (True, False):
            idx = [
                i
                for i, p in enumerate(prompts)
                if isinstance(p, RenderedPrompt) and p.add_special_tokens is flag
            ]
            if idx:
                ids = encode_in_batches(self.tokenizer, [prompts[i].text for i in idx], flag)
                for i, toks in zip(idx, ids):
                    out[i] = toks
        return out  # type: ignore[return-value]


def encode_in_batches(
    tokenizer: TokenizerLike, texts: list[str], add_special_tokens: bool
) -> list[list[int]]:
    """tokenizer.encode_batch over `texts` in batches of at most TOKENIZE_BATCH_CHARS
    characters (a longer text alone): a shard of long rows never tokenizes at once."""
    out: list[list[int]] = []
    start = 0
    while start < len(texts):
        end, chars = start + 1, len(texts[start])
        while end < len(texts) and chars + len(texts[end]) <= TOKENIZE_BATCH_CHARS:
            chars += len(texts[end])
            end += 1
        out += [list(ids) for ids in tokenizer.encode_batch(texts[start:end], add_special_tokens)]
        start = end
    return out


def order_requests(requests: list[Request]) -> list[Request]:
    """Group by shared prompt prefix (groups in first-seen order), longest first in a group.

    Prompts no longer than PREFIX_TOKENS form one group: their shared prefix is too short for
    prefix caching to matter, so only the length sort applies.
    """
    groups: dict[tuple[int, ...], list[Request]] = {}
    for r in requests:
        ids = r.prompt_token_ids
        key = tuple(ids[:PREFIX_TOKENS]) if len(ids) > PREFIX_TOKENS else ()
        groups.setdefault(key, []).append(r)
    ordered = []
    for group in groups.values():
        ordered += sorted(group, key=lambda r: -len(r.prompt_token_ids))
    return ordered


def with_source(source: str, message: str) -> str:
    """An engine error message prefixed with the row's file:line (the engine knows no files);
    not named twice when the message already starts with it, left alone without a source."""
    if source and not message.startswith(source):
        return f"{source}: {message}"
    return message


def to_result(
    request: Request, output: RequestOutput, token_bytes: TokenBytes | None = None
) -> ResultRow:
    """The output row for a finished request (n > 1: text/finish_reason/tokens become lists).

    With `token_bytes` (OpenAI-batch output) and a request that asked for log-probs, each
    sample's log-probs in the response shape of its endpoint (chat or completions).
    """
    base = dict(
        index=request.index,
        id=request.id,
        passthrough=request.passthrough,
        chat=request.chat,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=output.num_cached_tokens,
    )
    if output.error is not None or output.error_code is not None or not output.outputs:
        code = output.error_code or "engine_error"
        message = with_source(request.source, output.error or "the engine returned no output")
        return ResultRow(**base, error=message, error_code=code)
    samples = sorted(output.outputs, key=lambda o: o.index)
    k = request.params.logprobs
    logprobs = [None] * len(samples)
    if token_bytes is not None and k is not None:
        shape = chat_logprobs if request.chat else completion_logprobs
        logprobs = [shape(s.token_ids, s.logprobs or [], k, token_bytes) for s in samples]
    if request.params.n == 1:
        s = samples[0]
        return ResultRow(
            **base,
            text=s.text,
            finish_reason=s.finish_reason,
            num_output_tokens=len(s.token_ids),
            logprobs=logprobs[0],
            incomplete=s.incomplete,
        )
    return ResultRow(
        **base,
        text=[s.text for s in samples],
        finish_reason=[s.finish_reason for s in samples],
        num_output_tokens=[len(s.token_ids) for s in samples],
        logprobs=logprobs,
        incomplete=[s.incomplete for s in samples],
    )
