"""Grammar compiler (cache, refusals), per-sequence matchers (placeholders, EOS, rollback) and
the parallel mask filler, against llguidance's own matcher and plain Python bit arithmetic."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from batchgen.engine.sequence import PENDING_TOKEN, Sequence
from batchgen.engine.structured.bitmask import BitmaskFiller
from batchgen.engine.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    check_constraint,
)
from batchgen.engine.structured.manager import StructuredOutputs
from batchgen.engine.structured.matcher import SequenceMatcher
from batchgen.models.tokenizer import Tokenizer
from batchgen.sampling_params import SamplingParams
from batchgen.structured_outputs import StructuredOutputsParams as C

EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_json(), 576, [EOS])


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    """Set bits of one packed row, by plain Python arithmetic."""
    words = [w & 0xFFFFFFFF for w in mask_row.tolist()]
    return {i for i in range(vocab) if words[i // 32] >> (i % 32) & 1}


def test_one_compile_per_content(compiler):
    a = compiler.compile(C(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(C(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert isinstance(a, CompiledGrammar) and a is b
    assert compiler.cached(C(regex="never-compiled")) is None


def test_least_recently_used_is_evicted(tokenizer):
    small = GrammarCompiler(tokenizer.to_json(), 576, [EOS], cache_size=2)
    first = small.compile(C(regex="a"))
    small.compile(C(regex="b"))
    assert small.compile(C(regex="a")) is first  # a is now the most recent
    small.compile(C(regex="c"))  # evicts b
    assert small.cached(C(regex="b")) is None and small.cached(C(regex="a")) is first


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        (C(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (C(json={"type": "object", "not": {"required": ["a"]}}), "not"),
        (C(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
        (C(regex="(a"), "unclosed group"),
        (C(grammar="root ::= undefined_rule"), "undefined_rule"),
        (C(grammar="start: unknown"), "unknown"),
    ],
)
def test_refusals_are_errors_naming_the_key(compiler, constraint, needle):
    with pytest.raises(GrammarError, match=needle) as e:
        compiler.compile(constraint)
    assert e.value.code == "bad_structured_output"
    assert str(e.value).startswith(f"structured_outputs.{constraint.kind}: ")
    with pytest.raises(GrammarError):  # the refusal is cached and raised again
        compiler.cached(constraint)
    assert compiler.check(constraint) == str(e.value)
    assert needle in check_constraint(constraint)  # without a tokenizer too


def test_accepted_constraints_pass_every_check(compiler):
    for c in (C(json_object=True), C(choice=["a b", "c"]), C(grammar='root ::= "x" [0-9]+')):
        assert compiler.check(c) is None and check_constraint(c) is None


def _seq(prompt: list[int], outputs: list[int]) -> Sequence:
    seq = Sequence(0, "r", prompt, SamplingParams())
    seq.token_ids += outputs
    return seq


def test_matcher_follows_known_tokens_only(tokenizer, compiler):
    ids = _ids(tokenizer, "yes")
    state = SequenceMatcher(compiler.compile(C(choice=["yes", "no"])).matcher(), frozenset([EOS]))
    seq = _seq([5, 6], ids[:1] + [PENDING_TOKEN])
    assert state.sync(seq) is None and state.num_consumed == 1  # the placeholder waits
    seq.token_ids[-1:] = ids[1:] + [EOS]
    assert state.sync(seq) is None and state.num_consumed == len(ids)  # EOS not consumed
    assert state.complete(seq)
    del seq.token_ids[-2:]  # shorter than consumed: rolled back
    assert state.sync(seq) is None and state.num_consumed == len(ids) - 1
    assert not state.complete(seq)


def test_matcher_reports_a_refused_token(tokenizer, compiler):
    state = SequenceMatcher(compiler.compile(C(regex="[0-9]+")).matcher(), frozenset([EOS]))
    error = state.sync(_seq([5], _ids(tokenizer, "12x")))
    assert error and not state.complete(_seq([5], _ids(tokenizer, "12x")))


def test_filler_writes_each_matchers_mask(tokenizer, compiler):
    vocab = 576
    filler = BitmaskFiller(vocab, num_threads=2)
    digits = compiler.compile(C(regex="[0-9]{2}")).matcher()
    twin = compiler.compile(C(regex="[0-9]{2}")).matcher()  # a matcher serves one row only
    done = compiler.compile(C(choice=["no"])).matcher()
    assert done.consume_tokens(_ids(tokenizer, "no"))
    out = torch.zeros((4, filler.words), dtype=torch.int32)
    filler.fill(out, [digits, None, done, twin])
    want = _allowed(torch.frombuffer(bytearray(digits.compute_bitmask()), dtype=torch.int32), vocab)
    assert _allowed(out[0], vocab) == want == _allowed(out[3], vocab)
    assert want and all(tokenizer.decode([t]).isdigit() for t in want)
    assert _allowed(out[1], vocab) == set(range(vocab))  # no constraint
    assert _allowed(out[2], vocab) == {EOS}  # complete: only the end may follow
    with pytest.raises(ValueError, match="bitmask buffer must be"):
        filler.fill(torch.zeros((3, filler.words), dtype=torch.int32), [None] * 4)


def test_manager_compiles_new_constraints_off_thread(compiler):
    state = StructuredOutputs(compiler, frozenset([EOS]), num_threads=1)
    fresh = C(regex="z{3,5}")
    pending = state.prepare(fresh)
    assert isinstance(pending, Future)
    assert isinstance(pending.result(timeout=60), CompiledGrammar)
    assert state.prepare(fresh) is pending.result()  # now a cache hit
    state.close()
