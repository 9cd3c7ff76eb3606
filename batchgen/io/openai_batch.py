"""OpenAI Batch API output lines: one JSON object per result, as the Batch API writes them."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from batchgen.io.rows import ResultRow


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def output_line(result: ResultRow, model: str, created: int | None = None) -> dict[str, Any]:
    """The Batch API output record for one result (`response` null and `error` set on failure)."""
    digest = hashlib.blake2b(str(result.id).encode(), digest_size=12).hexdigest()
    line: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": result.id}
    if not result.ok:
        line["response"] = None
        line["error"] = {"code": result.error_code, "message": result.error}
        return line
    texts = _as_list(result.text)
    reasons = _as_list(result.finish_reason)
    logprobs = result.logprobs if isinstance(result.logprobs, list) else [result.logprobs]
    logprobs += [None] * (len(texts) - len(logprobs))
    completion = sum(_as_list(result.num_output_tokens))
    if result.chat:
        obj, choices = (
            "chat.completion",
            [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": t, "refusal": None},
                    "logprobs": lp,
                    "finish_reason": r,
                }
                for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))
            ],
        )
    else:
        obj, choices = (
            "text_completion",
            [
                {"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))
            ],
        )
    body = {
        "id": f"{'chatcmpl' if result.chat else 'cmpl'}-{digest}",
        "object": obj,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": result.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": result.num_prompt_tokens + completion,
        },
    }
    line["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": body}
    line["error"] = None
    return line
