"""Planner: row validation into error records, per-row params and seeds, request order."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))

from fake_engine import FakeTokenizer  # noqa: E402

from batchgen.engine.request_checks import ModelLimits  # noqa: E402
from batchgen.io.readers import OPENAI_KEY  # noqa: E402
from batchgen.io.rows import InputRow  # noqa: E402
from batchgen.job import PromptSpec  # noqa: E402
from batchgen.outputs import RequestOutput  # noqa: E402
from batchgen.plan.planner import Planner, Request, order_requests, row_seed, to_result  # noqa: E402
from batchgen.plan.prompts import PromptRenderer  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402


def planner(**kw):
    kw.setdefault("limits", ModelLimits(64, FakeTokenizer.vocab_size))
    kw.setdefault("base_params", {"max_tokens": 4})
    return Planner(PromptRenderer(PromptSpec(template="Q: {text}")), FakeTokenizer(), **kw)


def row(i, text, **data):
    return InputRow(i, f"id{i}", {"text": text, **data}, f"f:{i}")


def test_row_seed_is_stable_and_keyed():
    assert row_seed(0, "a") == row_seed(None, "a") != row_seed(1, "a")
    assert row_seed(0, "a") != row_seed(0, "b")
    assert 0 <= row_seed(5, "x") < 2**63
    assert row_seed(1234, "doc-1") == row_seed(1234, "doc-1")


def test_plan_validates_rows():
    plan = planner().plan(
        [
            row(0, "ok"),
            row(1, None),
            row(2, "x" * 80),
            InputRow(3, None, None, "f:3", "bad_json", "f:3: broken"),
        ]
    )
    assert [r.index for r in plan.requests] == [0]
    codes = {e.index: e.error_code for e in plan.errors}
    assert codes == {1: "null_text", 2: "prompt_too_long", 3: "bad_json"}
    too_long = next(e for e in plan.errors if e.index == 2)
    assert too_long.num_prompt_tokens == 84 and "f:2" in too_long.error
    req = plan.requests[0]
    assert req.prompt_token_ids == FakeTokenizer().encode("Q: ok")
    assert req.params.seed == row_seed(None, "id0") and req.params.max_tokens == 4


def test_overrides_column_and_multi():
    p = planner(overrides_column="o", allow_multi=False)
    plan = p.plan(
        [
            row(0, "a", o={"max_tokens": 2, "seed": 9}),
            row(1, "b", o='{"top_p": 2}'),
            row(2, "c", o={"n": 2}),
            row(3, "d", o="not json"),
            row(4, "e", o="[" * 100000),  # RecursionError in json.loads
            row(5, "f", o='{"stop": ["\\ud800"]}'),  # a lone surrogate: no text
        ]
    )
    assert plan.requests[0].params.max_tokens == 2 and plan.requests[0].params.seed == 9
    msgs = {e.index: e.error for e in plan.errors}
    assert set(msgs) == {1, 2, 3, 4, 5}
    assert "top_p" in msgs[1] and "sampling.n > 1" in msgs[2] and "not JSON" in msgs[3]
    assert "nested too deeply" in msgs[4] and "key 'stop[0]' holds a lone surrogate" in msgs[5]
    assert all(e.error_code == "bad_params" for e in plan.errors)


def test_order_groups_prefix_then_longest_first():
    p = SamplingParams()
    reqs = [
        Request(0, "a", [1] * 40 + [5], p),
        Request(1, "b", [2, 3], p),
        Request(2, "c", [1] * 40 + [5, 6, 7], p),
        Request(3, "d", [2, 3, 4], p),
    ]
    assert [r.index for r in order_requests(reqs)] == [2, 0, 3, 1]


def test_engine_error_names_the_row_source():
    req = Request(3, "r3", [0, 99999], SamplingParams(), source="data/in.jsonl:4")
    out = RequestOutput("0/3", [0, 99999], error="token id 99999 >= vocab 512", error_code="x")
    row = to_result(req, out)
    assert row.error == "data/in.jsonl:4: token id 99999 >= vocab 512" and row.error_code == "x"
    # Not named twice when the message already starts with it; no source, no prefix.
    assert to_result(req, RequestOutput("0/3", [], error=row.error)).error == row.error
    bare = Request(3, "r3", [0], SamplingParams())
    assert to_result(bare, RequestOutput("0/3", [], error="boom")).error == "boom"


def test_rows_the_engine_would_refuse_are_error_records():
    # The engine's own checks (request_checks.py) against limits 64 tokens, vocabulary 259.
    plan = planner(overrides_column="o").plan(
        [
            row(0, "x" * 55),  # 59 prompt tokens + max_tokens 4 = 63: fits
            row(1, "x" * 55, o={"max_tokens": 10}),  # 59 + 10 = 69 > 64
            row(2, "a", o={"max_tokens": 10_000_000}),  # no prompt leaves room for it
            row(3, "a", o={"stop_token_ids": [259]}),  # past the vocabulary
            row(4, "a", o={"n": 100_000}),  # more samples than MAX_N
        ]
    )
    assert [r.index for r in plan.requests] == [0]
    errors = {e.index: e for e in plan.errors}
    assert errors[1].error_code == "prompt_too_long" and errors[1].num_prompt_tokens == 59
    assert errors[1].error.startswith("f:1: prompt has 59 tokens + max_tokens 10 = 69, more than")
    assert errors[2].error_code == "bad_params"
    assert errors[2].error.startswith(
        "f:2: o.max_tokens=10000000: must be less than max_model_len=64"
    )
    assert errors[3].error == "f:3: o.stop_token_ids: 259 is not a token id (vocab size 259)"
    assert errors[4].error.startswith("f:4: o.n=100000: must be an integer in [1, 1024]")
    assert [errors[i].error_code for i in (2, 3, 4)] == ["bad_params"] * 3


def test_token_ids_past_the_models_vocabulary():
    # A tokenizer whose ids run past config.json's vocab_size: 'o' and 'k' encode to 114, 110.
    plan = planner(limits=ModelLimits(64, 100)).plan([row(0, "ok")])
    (error,) = plan.errors
    assert error.error_code == "invalid_token_id"
    assert error.error == "f:0: prompt has token id(s) outside [0, 100): [114, 110]"


def openai_row(i, body):
    data = {OPENAI_KEY: {"url": "/v1/completions", "body": body}}
    return InputRow(i, f"c{i}", data, f"b:{i}")


def test_pretokenized_prompts_and_body_fields_are_checked():
    plan = planner(base_params={"max_tokens": 4}).plan(
        [
            openai_row(0, {"prompt": [1, 2, 3]}),
            openai_row(1, {"prompt": [1, 2, 259]}),
            openai_row(2, {"prompt": [1, True]}),  # JSON true is an int to Python
            openai_row(3, {"prompt": [1, -4]}),
            openai_row(4, {"prompt": [1, 2], "max_tokens": 10_000_000}),
        ]
    )
    assert [r.index for r in plan.requests] == [0]
    codes = {e.index: e.error_code for e in plan.errors}
    assert codes == {
        1: "invalid_token_id",
        2: "invalid_token_id",
        3: "invalid_token_id",
        4: "bad_params",
    }
    messages = {e.index: e.error for e in plan.errors}
    assert messages[2] == "b:2: prompt has token id(s) outside [0, 259): [True]"
    assert messages[4].startswith("b:4: body.max_tokens=10000000: must be less than")


def test_a_job_value_the_model_cannot_take_names_sampling():
    plan = planner(base_params={"max_tokens": 100}).plan([row(0, "a")])
    assert plan.errors[0].error.startswith("f:0: sampling.max_tokens=100: must be less than")


class CountingTokenizer(FakeTokenizer):
    """Records the characters of every encode_batch call."""

    def __init__(self):
        self.calls: list[int] = []

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls.append(sum(len(t) for t in texts))
        return super().encode_batch(texts, add_special_tokens)


def test_rows_just_under_the_limit_tokenize_in_bounded_batches(monkeypatch):
    # 1,024 rows just under input.max_row_bytes (scaled down: 4 KiB rows, 64 Ki-character
    # batches, as 4 MiB rows and 4 Mi-character batches): never all of them in one call.
    from batchgen.plan import planner as planner_module

    monkeypatch.setattr(planner_module, "TOKENIZE_BATCH_CHARS", 64 << 10)
    tok = CountingTokenizer()
    p = Planner(
        PromptRenderer(PromptSpec(template="Q: {text}")),
        tok,
        ModelLimits(1 << 20, FakeTokenizer.vocab_size),
        {"max_tokens": 4},
    )
    rows = [row(i, "y" * (4096 - 8)) for i in range(1024)]
    plan = p.plan(rows)
    assert len(plan.requests) == 1024 and not plan.errors
    assert sum(tok.calls) == 1024 * 4091  # every prompt once
    assert max(tok.calls) <= 64 << 10 and len(tok.calls) >= 1024 * 4091 // (64 << 10)
    # A single prompt over the batch size goes alone.
    tok.calls.clear()
    p.plan([row(0, "a" * 100_000), row(1, "b")])
    assert tok.calls == [100_003, 4]
