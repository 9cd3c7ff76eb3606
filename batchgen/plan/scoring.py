"""Tokenization for scoring: candidate tokens exactly as the model would have generated them."""

from __future__ import annotations

from batchgen.models.tokenizer import Tokenizer


def tokenize_for_scoring(
    tokenizer: Tokenizer, prompt: str | list[int], candidates, separator: str = ""
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, per-candidate ids).

    Text join rule: the prompt is encoded alone with special tokens (BOS); each candidate's ids
    are the ids of `prompt + separator + candidate` (also with BOS) after the prompt's ids, when
    the joined encoding starts with them. If the merge across the boundary changes the prompt's
    last tokens, the candidate is encoded on its own without special tokens (separator
    included), so no BOS ever lands in the middle. Token-id inputs are used as they are.
    """
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt) if prompt else []
    else:
        prompt_ids = list(prompt)
    out: list[list[int]] = []
    for cand in candidates:
        if not isinstance(cand, str):
            out.append(list(cand))
            continue
        if not cand:
            out.append([])
            continue
        if isinstance(prompt, str):
            joined = tokenizer.encode(prompt + separator + cand)
            if joined[: len(prompt_ids)] == prompt_ids and len(joined) > len(prompt_ids):
                out.append(joined[len(prompt_ids) :])
                continue
        out.append(tokenizer.encode(separator + cand, add_special_tokens=False))
    return prompt_ids, out
