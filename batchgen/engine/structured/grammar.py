"""Compiling structured_outputs constraints into llguidance grammars and matchers, cached.

llguidance (Rust, with Python bindings) builds a grammar's lexer and parser lazily: creating a
matcher for a new constraint takes about a millisecond for a ten-field extraction schema at a
151,936-token vocabulary, and each state's token mask is computed when first reached. A
compiled constraint is kept as a template matcher; every sequence gets a copy of it (about a
microsecond), so one schema is compiled once however many rows use it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance

from batchgen.structured_outputs import StructuredOutputsParams

# JSON is written compactly and deterministically: ", " between items and ": " after keys (the
# separators of most JSON a model has read), no other whitespace. Free whitespace would let a
# weak model spend its max_tokens on blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ERROR_CODE = "bad_structured_output"
# Distinct constraints kept compiled (a job with a schema per row keeps the recent ones).
CACHE_SIZE = 1024


class GrammarError(ValueError):
    """A constraint the grammar library refuses: an invalid schema, regex or grammar, or a
    schema keyword it cannot enforce. The message names the structured_outputs key."""

    code = ERROR_CODE


def grammar_text(constraint: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (no tokenizer needed); GrammarError if it cannot
    be written as one (a GBNF rule that refers to no rule, a schema that is not JSON)."""
    kind = constraint.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.json, defaults=JSON_OPTIONS
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(constraint.choice)))
        return llguidance.grammar_from("grammar", constraint.grammar)  # GBNF or Lark
    except Exception as e:  # the bindings raise ValueError and converter-specific errors
        raise GrammarError(_message(kind, str(e))) from None


def check_constraint(constraint: StructuredOutputsParams) -> str | None:
    """Why the library refuses the constraint (no tokenizer needed), or None: the check a job
    gets before its model loads."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint), None)
    except GrammarError as e:
        return str(e)
    return _message(constraint.kind, error) if error else None


def _message(kind: str, error: str) -> str:
    # One line (an error record's message, a job error): the library's caret diagrams go.
    error = " ".join(error.split())
    hint = ""
    if "Unimplemented keys" in error:
        hint = " (the grammar engine cannot enforce these keywords: drop them or loosen the schema)"
    return f"structured_outputs.{kind}: {error}{hint}"


class CompiledGrammar:
    """One constraint compiled for one tokenizer: a template matcher in its start state."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (a copy of the template)."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles constraints against one tokenizer, keeping the last CACHE_SIZE by content.

    Thread-safe: the engine compiles new constraints on a worker thread while steps run.

    Args:
        tokenizer_json: the tokenizer's tokenizer.json text (the `tokenizers` format).
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        eos_token_ids: tokens that end the output; a matcher allows them only where the
            constraint is complete.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        eos = sorted(set(eos_token_ids))
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos or None
        )
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, constraint: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled constraint if it is in the cache (GrammarError if it failed), else None."""
        with self._lock:
            hit = self._cache.get(constraint.key)
            if hit is not None:
                self._cache.move_to_end(constraint.key)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, from the cache or built now; GrammarError if refused (the
        refusal is cached too)."""
        hit = self.cached(constraint)
        if hit is not None:
            return hit
        try:
            result: CompiledGrammar | GrammarError = self._build(constraint)
        except GrammarError as e:
            result = e
        with self._lock:
            self._cache[constraint.key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(result, GrammarError):
            raise result
        return result

    def check(self, constraint: StructuredOutputsParams) -> str | None:
        """compile's error message, or None when the constraint compiles."""
        try:
            self.compile(constraint)
        except GrammarError as e:
            return str(e)
        return None

    def _build(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        text = grammar_text(constraint)
        # The constructor never raises for a bad grammar: the matcher is left in error.
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise GrammarError(_message(constraint.kind, template.get_error()))
        return CompiledGrammar(template)
