"""Prompts: render input rows as prompt text ({column} template, or chat template in a worker).

A `{column}` template is filled here (plain string formatting). A chat template is untrusted
code: it runs only in the template worker (template_process.py), under a wall-clock and a
memory limit, rows sent to it in batches.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.job.spec import PromptSpec
from batchgen.plan.template_process import RenderStopped, TemplateLimits, TemplateProcess
from batchgen.short_repr import short_repr

__all__ = [
    "Conversation",
    "PromptError",
    "PromptRenderer",
    "RenderStopped",
    "RenderedPrompt",
    "TemplateLimits",
]


class PromptError(ValueError):
    """A prompt cannot be rendered; `code` is the stable row error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    add_special_tokens: bool  # False when a chat template already wrote BOS itself


def _fill(text: str, row: dict[str, Any]) -> str:
    out = []
    for literal, name, _, _ in string.Formatter().parse(text):
        out.append(literal)
        if name is None:
            continue
        if name not in row:
            raise PromptError("missing_column", f"column {name!r} is missing from this row")
        out.append(_text(name, row[name]))
    return "".join(out)


def _text(name: str, value: Any) -> str:
    """A column's value as prompt text: a string as is, an integer or float as its decimal
    text (7, 2.5, 1e+20, nan). Anything else (a list, object, bool, bytes, date) has no one
    obvious text: that row is a bad_text error, never Python's str() of it."""
    if isinstance(value, str):
        return value
    if value is None:
        raise PromptError("null_text", f"column {name!r} is null")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise PromptError(
        "bad_text",
        f"column {name!r} holds {type(value).__name__} {short_repr(value)}, not text; "
        "prompt columns take strings (or numbers)",
    )


@dataclass(frozen=True)
class Conversation:
    """A chat prompt before its template runs: the messages the chat template is given."""

    messages: list[dict[str, Any]]


class PromptRenderer:
    """Renders rows into prompt text for one job.

    Args:
        spec: the job's prompt section.
        chat_template: the model's chat template (spec.chat_template takes precedence).
        bos_token / eos_token: the tokenizer's special token strings, given to chat templates.
        limits: hard limits on each chat-template render (template_process.TemplateLimits).
        should_stop: polled while a chat template renders; True stops the render at once
            (RenderStopped), so a stop signal never waits on a template.

    A renderer that rendered chat rows holds a worker process: call close() when done (or use
    it as a context manager).
    """

    def __init__(
        self,
        spec: PromptSpec,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        limits: TemplateLimits | None = None,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.spec = spec
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits or TemplateLimits()
        self.should_stop = should_stop
        self._source = spec.chat_template or chat_template
        self._process: TemplateProcess | None = None

    def __enter__(self) -> PromptRenderer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None

    def check(self, needs_chat: bool) -> None:
        """Fail early (PromptError) if chat prompts are needed but the template is unusable:
        missing, not compiling, or failing on a one-message conversation."""
        if not needs_chat:
            return
        error = self._template_process().check()
        if error is not None:
            raise PromptError("template_error", error)
        self.render_messages([{"role": "user", "content": "probe"}])

    def _template_process(self) -> TemplateProcess:
        if self._process is None:
            if not self._source:
                raise PromptError(
                    "template_error",
                    "chat prompts need a chat template, but the model has none; set "
                    "prompt.chat_template or use prompt.template",
                )
            self._process = TemplateProcess(
                self._source,
                self.bos_token or "",
                self.eos_token or "",
                self.limits,
                self.should_stop,
            )
        return self._process

    def prepare(self, row: dict[str, Any]) -> RenderedPrompt | Conversation:
        """A row of the job's own prompt spec: the filled template's text, or the filled
        chat messages still to be rendered (render_conversations). Raises PromptError."""
        if self.spec.template is not None:
            return RenderedPrompt(_fill(self.spec.template, row), add_special_tokens=True)
        if self.spec.chat is None:
            raise PromptError("template_error", "the job has no prompt.template or prompt.chat")
        return Conversation(
            [{"role": m.role, "content": _fill(m.content, row)} for m in self.spec.chat]
        )

    def render_conversations(
        self, conversations: list[list[dict[str, Any]]]
    ) -> list[RenderedPrompt | PromptError]:
        """Each conversation through the chat template (one batch to the worker): its prompt,
        or the PromptError (template_error) it failed with. Raises RenderStopped."""
        if not conversations:
            return []
        try:
            process = self._template_process()
        except PromptError as e:
            return [e] * len(conversations)
        out: list[RenderedPrompt | PromptError] = []
        for result in process.render(conversations):
            if result.text is None:
                out.append(PromptError("template_error", result.error or "chat template failed"))
                continue
            has_bos = bool(self.bos_token) and result.text.startswith(self.bos_token)
            out.append(RenderedPrompt(result.text, add_special_tokens=not has_bos))
        return out

    def render_rows(self, rows: list[dict[str, Any]]) -> list[RenderedPrompt | PromptError]:
        """prepare() then render_conversations() for many rows: each row's prompt or error."""
        out: list[RenderedPrompt | PromptError | Conversation] = []
        for row in rows:
            try:
                out.append(self.prepare(row))
            except PromptError as e:
                out.append(e)
        chats = [i for i, p in enumerate(out) if isinstance(p, Conversation)]
        done = self.render_conversations([out[i].messages for i in chats])  # type: ignore[union-attr]
        for i, result in zip(chats, done):
            out[i] = result
        return out  # type: ignore[return-value]

    def render_messages(self, messages: list[dict[str, Any]]) -> RenderedPrompt:
        """One conversation through the chat template; raises PromptError."""
        (result,) = self.render_conversations([messages])
        if isinstance(result, PromptError):
            raise result
        return result

    def render(self, row: dict[str, Any]) -> RenderedPrompt:
        """Render a row of the job's own prompt spec (template or chat); raises PromptError."""
        (result,) = self.render_rows([row])
        if isinstance(result, PromptError):
            raise result
        return result
