"""Chat templates in jinja2's immutable sandbox: compile and render one conversation.

Only the template worker (template_worker.py) runs this: a template is untrusted code (it
ships with a downloaded model), and the checks here (a deadline on attribute access, calls and
output; a size check on `*` and `**`) can be bypassed by a loop that touches nothing, or a
filter that builds a huge value in one call. The worker's process limits are the bound that
holds; these checks give the common cases a precise message first.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateFailure(Exception):
    """A chat template did not compile or render; the message says why."""


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


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a deadline checked on every attribute, item and call, and a
    size check on `*` and `**` (the ways one expression builds something huge)."""

    intercepted_binops = frozenset(["*", "**"])
    deadline = math.inf
    timeout_s = math.inf
    max_chars = 1 << 62

    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"rendering took over {self.timeout_s:g} s")

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
                    if len(seq) * times > self.max_chars:
                        raise SecurityError(f"'*' would build over {self.max_chars} items")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
            raise SecurityError("'**' with an exponent over 1024")
        return super().call_binop(context, operator, left, right)


def compile_chat_template(source: str, timeout_s: float, max_chars: int) -> jinja2.Template:
    """Compile `source` in the bounded sandbox; raises TemplateFailure.

    Compiling runs template code too: jinja2 evaluates filters on constants while compiling
    (`{{ "x"|center(10**9) }}` builds its gigabyte before any render), so the worker compiles
    under the same limits as it renders.
    """
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, undefined=_Undefined, autoescape=False
    )
    env.timeout_s, env.max_chars = timeout_s, max_chars
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TemplateFailure(f"chat template does not compile: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise TemplateFailure(f"chat template does not compile: {type(e).__name__}") from None


def render_chat(
    template: jinja2.Template, messages: list[dict[str, Any]], bos_token: str, eos_token: str
) -> str:
    """One conversation through a compiled template, under its environment's limits; raises
    TemplateFailure."""
    env = template.environment
    env.deadline = time.monotonic() + env.timeout_s
    try:
        parts, size = [], 0
        for part in template.generate(
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
        ):
            size += len(part)
            if size > env.max_chars:
                raise SecurityError(f"output over {env.max_chars} characters")
            env._tick()
            parts.append(part)
        text = "".join(parts)
        text.encode("utf-8")  # a lone surrogate from a "\ud800" literal is no text
    except SecurityError as e:
        raise TemplateFailure(f"chat template refused by sandbox: {e}") from None
    except TemplateError as e:
        raise TemplateFailure(f"chat template failed: {e}") from None
    except MemoryError:  # the worker's RLIMIT_AS: freed again once this frame unwinds
        raise TemplateFailure("chat template exceeded the template worker's memory limit") from None
    except UnicodeEncodeError:
        raise TemplateFailure("chat template wrote a lone surrogate, which is no text") from None
    except Exception as e:  # a template can raise anything a filter raises
        raise TemplateFailure(f"chat template failed: {e!r}") from None
    finally:
        env.deadline = math.inf
    return text
