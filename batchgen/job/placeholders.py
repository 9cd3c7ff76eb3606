"""The `{column}` placeholders of a job's prompt: which input columns it reads."""

from __future__ import annotations

import string

from batchgen.job.spec import JobError, PromptSpec


def format_fields(text: str, where: str) -> list[str]:
    """Plain column names used as `{column}` in `text`; attribute/index access is refused."""
    names = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        hint = "write a literal brace as {{ or }}"
        raise JobError(f"{where}: {e} ({hint})") from None
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name or not all(ch.isalnum() or ch in "_- " for ch in name) or spec or conv:
            raise JobError(
                f"{where}: placeholder {{{name}{'!' + conv if conv else ''}"
                f"{':' + spec if spec else ''}}} is not allowed; use a plain column name like "
                "{text} (no attribute, index, conversion or format spec)",
            )
        names.append(name)
    return names


def placeholders(spec: PromptSpec) -> list[str]:
    """Column names a prompt spec reads, in first-use order (raises JobError naming the key
    if one is malformed)."""
    names: list[str] = []
    if spec.template is not None:
        names += format_fields(spec.template, "prompt.template")
    for i, msg in enumerate(spec.chat or ()):
        names += format_fields(msg.content, f"prompt.chat[{i}].content")
    return list(dict.fromkeys(names))
