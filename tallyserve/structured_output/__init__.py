"""Structured outputs (constrained decoding) through xgrammar: compile cache, per-request matchers, bitmasks."""
