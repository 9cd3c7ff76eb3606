"""The prompt forms LLM.generate and LLM.chat accept, as vLLM spells them, checked up front."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchgen.short_repr import short_repr

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_list(prompts: Any) -> list[str | list[int]]:
    """Each prompt as text or a token-id list.

    Accepted per item: a string, a list of token ids, `{"prompt": text}` or
    `{"prompt_token_ids": [ids]}`; a lone string or dict is one prompt. Token ids are checked
    by the engine (a bad id makes that prompt's output an error), everything else here.

    Raises:
        ValueError: naming the item's index and the key or type that is wrong.
    """
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts: expected a list of prompts, got {type(prompts).__name__} "
            f"{short_repr(prompts)}"
        )
    return [_one_prompt(item, i) for i, item in enumerate(prompts)]


def _one_prompt(item: Any, i: int) -> str | list[int]:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in item:
            if key not in PROMPT_KEYS:
                raise ValueError(
                    f"prompts[{i}]: unknown key {key!r}; a prompt dict holds 'prompt' (text) "
                    "or 'prompt_token_ids' (a list of token ids)"
                )
        if len(item) != 1:
            raise ValueError(
                f"prompts[{i}]: give one of 'prompt' or 'prompt_token_ids', not "
                f"{'both' if item else 'neither'}"
            )
        if "prompt" in item:
            if not isinstance(item["prompt"], str):
                raise ValueError(
                    f"prompts[{i}]['prompt']: expected a string, got "
                    f"{type(item['prompt']).__name__} {short_repr(item['prompt'])}"
                )
            return item["prompt"]
        ids = item["prompt_token_ids"]
        if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence):
            raise ValueError(
                f"prompts[{i}]['prompt_token_ids']: expected a list of token ids, got "
                f"{type(ids).__name__} {short_repr(ids)}"
            )
        return list(ids)
    if isinstance(item, (list, tuple)):
        return list(item)
    hint = (
        " (one token-id prompt is a list inside the list: [[1, 2, 3]])"
        if isinstance(item, int)
        else ""
    )
    raise ValueError(
        f"prompts[{i}]: expected a string, a list of token ids or a dict with 'prompt' / "
        f"'prompt_token_ids', got {type(item).__name__} {short_repr(item)}{hint}"
    )


def conversation_list(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of {role, content} messages) or a list of them, as a list.

    Raises:
        ValueError: naming the conversation and message index that is malformed.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(
            "messages: expected a non-empty list of {role, content} messages, or a list of such "
            f"lists, got {short_repr(messages)}"
        )
    single = isinstance(messages[0], dict)
    batch = [messages] if single else list(messages)
    for c, conversation in enumerate(batch):
        where = "messages" if single else f"messages[{c}]"
        if (
            not isinstance(conversation, Sequence)
            or isinstance(conversation, (str, bytes))
            or not conversation
        ):
            raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages")
        for m, message in enumerate(conversation):
            at = f"{where}[{m}]"
            if not isinstance(message, dict):
                raise ValueError(f"{at}: expected a dict with 'role' and 'content'")
            if not isinstance(message.get("role"), str):
                raise ValueError(f"{at}['role']: expected a string such as 'user'")
            if not isinstance(message.get("content"), str):
                raise ValueError(
                    f"{at}['content']: expected a string, got {short_repr(message.get('content'))}"
                )
    return [list(c) for c in batch]
