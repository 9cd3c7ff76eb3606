"""Prompts: render an input row as prompt text ({column} template or sandboxed chat template)."""

from __future__ import annotations

import math
import string
import time
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchgen.job.spec import PromptSpec


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
        value = row[name]
        if value is None:
            raise PromptError("null_text", f"column {name!r} is null")
        out.append(value if isinstance(value, str) else str(value))
    return "".join(out)


class _Undefined(jinja2.Undefined):
    """Lenient like HF's chat templates, except that a refused (unsafe) access always fails."""

    def _check(self) -> None:
        if self._undefined_exception is SecurityError:
            self._fail_with_undefined_error()

    def __str__(self) -> str:
        self._check()
        return super().__str__()

    def __bool__(self) -> bool:
        self._check()
        return super().__bool__()

    def __iter__(self):
        self._check()
        return super().__iter__()


def _raise_exception(message: str):
    raise TemplateError(message)


# A chat template renders one row under limits, so a loop driven by the row's data or a huge
# string is that row's template_error, never a stalled job (a stop signal waits for a render)
# or an exhausted host.
RENDER_TIMEOUT_S = 10.0
MAX_RENDER_CHARS = 16 * 1024 * 1024


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a deadline checked on every attribute, item and call, and a
    size check on `*` and `**` (the ways one expression builds something huge)."""

    intercepted_binops = frozenset(["*", "**"])
    deadline = math.inf

    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"rendering took over {RENDER_TIMEOUT_S:g} s")

    def getattr(self, obj, attribute):
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._tick()
        return super().getitem(obj, argument)

    def call(self, __context, __obj, *args, **kwargs):
        self._tick()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        self._tick()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    if len(seq) * times > MAX_RENDER_CHARS:
                        raise SecurityError(f"'*' would build over {MAX_RENDER_CHARS} items")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
            raise SecurityError("'**' with an exponent over 1024")
        return super().call_binop(context, operator, left, right)


def compile_chat_template(source: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, undefined=_Undefined, autoescape=False
    )
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise PromptError("template_error", f"chat template does not compile: {e}") from None


class PromptRenderer:
    """Renders rows into prompt text for one job.

    Args:
        spec: the job's prompt section.
        chat_template: the model's chat template (spec.chat_template takes precedence).
        bos_token / eos_token: the tokenizer's special token strings, given to chat templates.
    """

    def __init__(
        self,
        spec: PromptSpec,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ):
        self.spec = spec
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._source = spec.chat_template or chat_template
        self._template: jinja2.Template | None = None

    def check(self, needs_chat: bool) -> None:
        """Fail early (PromptError) if chat prompts are needed but the template is unusable."""
        if not needs_chat:
            return
        self._chat_template()
        self.render_messages([{"role": "user", "content": "probe"}])

    def _chat_template(self) -> jinja2.Template:
        if self._template is None:
            if not self._source:
                raise PromptError(
                    "template_error",
                    "chat prompts need a chat template, but the model has none; set "
                    "prompt.chat_template or use prompt.template",
                )
            self._template = compile_chat_template(self._source)
        return self._template

    def render_messages(self, messages: list[dict[str, Any]]) -> RenderedPrompt:
        template = self._chat_template()
        env = template.environment
        env.deadline = time.monotonic() + RENDER_TIMEOUT_S
        try:
            parts, size = [], 0
            for part in template.generate(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            ):
                size += len(part)
                if size > MAX_RENDER_CHARS:
                    raise SecurityError(f"output over {MAX_RENDER_CHARS} characters")
                env._tick()
                parts.append(part)
            text = "".join(parts)
        except SecurityError as e:
            raise PromptError("template_error", f"chat template refused by sandbox: {e}") from None
        except TemplateError as e:
            raise PromptError("template_error", f"chat template failed: {e}") from None
        except Exception as e:  # a template can raise anything a filter raises
            raise PromptError("template_error", f"chat template failed: {e!r}") from None
        finally:
            env.deadline = math.inf
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return RenderedPrompt(text, add_special_tokens=not has_bos)

    def render(self, row: dict[str, Any]) -> RenderedPrompt:
        """Render a row of the job's own prompt spec (template or chat)."""
        if self.spec.template is not None:
            return RenderedPrompt(_fill(self.spec.template, row), add_special_tokens=True)
        if self.spec.chat is None:
            raise PromptError("template_error", "the job has no prompt.template or prompt.chat")
        msgs = [{"role": m.role, "content": _fill(m.content, row)} for m in self.spec.chat]
        return self.render_messages(msgs)
