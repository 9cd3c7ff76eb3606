"""Structured output: grammars compiled from constraints, per-sequence matchers, token masks."""
