"""Structured output end to end on a tiny random model (its free output is noise, so every valid
output is the constraint's doing): JSON schemas checked with `jsonschema`, regexes with
re.fullmatch, choices, a GBNF grammar's outputs parsed, cut outputs checked as valid prefixes
with the grammar library's own matcher, and bad constraints as error outputs."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import llguidance
import pytest
from structured_schemas import MAX_TOKENS, SCHEMAS

from batchgen import LLM, SamplingParams
from batchgen.engine.structured.grammar import JSON_OPTIONS


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=512)


def _json_rows(per_schema: int) -> tuple[list[str], list[SamplingParams], list[str]]:
    """per_schema rows of each schema: every tenth greedy, the rest sampled at temperature 1
    (some with top-k / top-p / a repetition penalty), prompts sharing a prefix."""
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        for i in range(per_schema):
            extra = [{}, {"top_k": 20}, {"top_p": 0.9}, {"repetition_penalty": 1.2}][i % 4]
            prompts.append(f"Answer with the {name} as JSON. Row {i}:")
            params.append(
                SamplingParams(
                    max_tokens=MAX_TOKENS[name],
                    temperature=0.0 if i % 10 == 0 else 1.0,
                    seed=i,
                    structured_outputs={"json": schema},
                    **extra,
                )
            )
            names.append(name)
    return prompts, params, names


def _library_matcher(llm: LLM, grammar: str) -> llguidance.LLMatcher:
    """A matcher built by llguidance itself from the tokenizer file (not batchgen's compiler)."""
    vocab = llm.engine.limits.vocab_size
    tok = llguidance.LLTokenizer(llm.tokenizer.to_json(), n_vocab=vocab, eos_token=1)
    return llguidance.LLMatcher(tok, grammar, log_level=0)


def _is_valid_prefix(llm: LLM, grammar: str, token_ids: list[int]) -> bool:
    matcher = _library_matcher(llm, grammar)
    return matcher.consume_tokens(token_ids) and not matcher.is_error()


def _check_json_rows(llm: LLM, per_schema: int) -> None:
    prompts, params, names = _json_rows(per_schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    validators = {n: jsonschema.Draft202012Validator(s) for n, s in SCHEMAS.items()}
    stops = 0
    for out, name in zip(outs, names):
        assert out.error is None, out.error
        sample = out.outputs[0]
        if sample.finish_reason == "stop":
            stops += 1
            validators[name].validate(json.loads(sample.text))  # raises if invalid
            assert sample.incomplete is False
        else:
            assert sample.finish_reason == "length" and sample.incomplete is True
            assert len(sample.token_ids) == MAX_TOKENS[name]
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                SCHEMAS[name], defaults=JSON_OPTIONS
            )
            assert _is_valid_prefix(llm, grammar, sample.token_ids), sample.text
    assert stops >= 0.8 * len(outs), f"{stops} of {len(outs)} rows finished with stop"
    # Each schema's rows are not one output repeated: the draws are seeded per row.
    for name in SCHEMAS:
        assert len({o.text for o, n in zip(outs, names) if n == name}) >= 5, name


def test_json_schemas_hold_on_every_row(llm):
    _check_json_rows(llm, per_schema=30)


@pytest.mark.slow
def test_json_schemas_hold_on_200_rows_each(llm):
    _check_json_rows(llm, per_schema=200)


def test_regex_choice_and_grammar(llm):
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}(\.[0-9])?"
    choices = ["yes", "no", "maybe later"]
    gbnf = 'root ::= "[" num ("," num){0,3} "]"\nnum ::= [1-9] [0-9]?'
    lark = 'start: "(" WORD (" " WORD){0,3} ")"\nWORD: /[a-z]{1,4}/'
    cases = [("regex", regex), ("choice", choices), ("grammar", gbnf), ("grammar", lark)]
    prompts, params = [], []
    for kind, value in cases:
        for i in range(24):
            prompts.append(f"{kind} {i}:")
            params.append(
                SamplingParams(
                    max_tokens=48,
                    temperature=0.0 if i == 0 else 1.0,
                    seed=i,
                    structured_outputs={kind: value},
                )
            )
    outs = llm.generate(prompts, params, use_tqdm=False)
    by_case = [outs[i * 24 : (i + 1) * 24] for i in range(len(cases))]
    for outs_ in by_case:
        assert all(o.finish_reason == "stop" and o.outputs[0].incomplete is False for o in outs_)
    assert all(re.fullmatch(regex, o.text) for o in by_case[0]), [o.text for o in by_case[0]]
    assert all(o.text in choices for o in by_case[1])
    assert len({o.text for o in by_case[1]}) > 1  # sampled, not one forced answer
    for o in by_case[2]:  # the GBNF language is Python list syntax: parse it as such
        value = ast.literal_eval(o.text)
        assert isinstance(value, list) and 1 <= len(value) <= 4
        assert all(isinstance(v, int) and 1 <= v <= 99 for v in value), o.text
    for o in by_case[3]:
        assert re.fullmatch(r"\([a-z]{1,4}( [a-z]{1,4}){0,3}\)", o.text), o.text


def test_cut_outputs_are_valid_prefixes_and_never_end_early(llm):
    schema = SCHEMAS["order"]
    params = [
        SamplingParams(max_tokens=m, temperature=1.0, seed=i, structured_outputs={"json": schema})
        for i, m in enumerate([5, 17, 33, 45] * 4)
    ]
    outs = llm.generate(["Order:"] * len(params), params, use_tqdm=False)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    for out, p in zip(outs, params):
        sample = out.outputs[0]
        assert sample.finish_reason == "length" and sample.incomplete is True
        assert len(sample.token_ids) == p.max_tokens
        assert _is_valid_prefix(llm, grammar, sample.token_ids), sample.text
        assert not set(sample.token_ids) & llm.engine.eos_token_ids


def test_bad_constraints_are_error_outputs_others_unaffected(llm):
    good = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"choice": ["ok"]})
    bad = [
        {"json": {"type": "array", "uniqueItems": True}},  # a keyword the engine cannot enforce
        {"json": {"type": "strin"}},
        {"regex": "(unclosed"},
        {"grammar": "root ::= missing_rule"},
    ]
    params = [good] + [SamplingParams(max_tokens=8, structured_outputs=b) for b in bad] + [good]
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    assert outs[0].text == outs[-1].text == "ok"
    for out in outs[1:-1]:
        assert out.finish_reason == "error" and out.error_code == "bad_structured_output"
    assert "uniqueItems" in outs[1].error and "structured_outputs.json" in outs[1].error
    assert "strin" in outs[2].error and "unclosed" in outs[3].error
    assert "structured_outputs.grammar" in outs[4].error


def test_a_schema_per_row_compiles_and_holds(llm):
    # 12 distinct schemas, none compiled before: each compiles once, off the step path.
    schemas = [
        {
            "type": "object",
            "properties": {f"k{i}": {"enum": [f"v{i}", f"w{i}"]}, "n": {"type": "integer"}},
            "required": [f"k{i}"],
            "additionalProperties": False,
        }
        for i in range(12)
    ]
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured_outputs={"json": s})
        for i, s in enumerate(schemas * 2)
    ]
    outs = llm.generate(["Row:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        assert out.error is None
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), p.structured_outputs.json)
    assert sum(o.finish_reason == "stop" for o in outs) >= 0.8 * len(outs)


def test_a_matcher_that_refuses_fails_its_request_alone(llm, monkeypatch):
    # The mask makes a refusal impossible; should a matcher still refuse (a library bug), its
    # request ends as an error output instead of drawing unconstrained, and no other is hurt.
    structured = llm.engine._structured()
    real_fill = type(structured).fill

    def fill(self, out, seqs):
        errors = real_fill(self, out, seqs)
        bad = [s for s in seqs if s.request_id == "1" and s.num_output_tokens >= 3]
        return errors + [(s, "refused for the test") for s in bad[:1]]

    monkeypatch.setattr(type(structured), "fill", fill)
    params = SamplingParams(max_tokens=40, seed=1, structured_outputs={"regex": "[a-z]{20,30}"})
    outs = llm.generate(["a", "b", "c"], [params] * 3, use_tqdm=False)
    assert outs[1].finish_reason == "error" and outs[1].error_code == "structured_output_failed"
    assert "refused for the test" in outs[1].error
    assert all(re.fullmatch("[a-z]{20,30}", outs[i].text) for i in (0, 2))
