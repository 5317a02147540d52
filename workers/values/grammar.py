"""Structured output's grammars, compiled by llguidance (no torch: the router checks a request's grammar with the
same compiler the workers run, so an unsupported schema feature is a 400 naming it, not a failed generation).

Chosen over xgrammar by measurement on this machine (SmolLM2's 49,152-token vocabulary, a nested JSON schema,
53 tokens): xgrammar fills a step's masks 7-10x faster (0.23 against 1.6 ms at 64 rows), but imports torch, triton
and transformers (the router stays torch-free) and compiles each schema first; llguidance's 1.6 ms is 2% of a
64-row decode step, and applying the masks is our own torch op (`workers.engine.grammar_masks.mask_disallowed`).
"""

import json

import llguidance

from workers.values.sampling_params import GrammarSpec

# JSON as `json.dumps` writes it: {"a": 1, "b": [2, 3]}. Flexible whitespace lets a small model pad an answer
# with newlines until it runs out of tokens (SmolLM2 did, on seeded schemas at temperature 0.7).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_definition(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec; ValueError for a spec that cannot be read (bad JSON, bad GBNF)."""
    try:
        if spec.format == "choice":
            choices = json.loads(spec.text)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choices must be a non-empty list of strings")
        if spec.format == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_LAYOUT)
        return llguidance.grammar_from(spec.format, spec.text)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{spec.format}: {error}") from None


def check_grammar(spec: GrammarSpec) -> None:
    """ValueError naming what llguidance cannot serve in the spec (an unsupported schema keyword, a bad pattern)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_definition(spec))
    if is_error:
        raise ValueError(f"{spec.format}: {messages[0]}")
