"""Structured output's request fields, every spelling to one checked grammar, and the 400s (pure: no Ray, no model)."""

import json

import pytest

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.errors import APIError
from cluster.ingress.structured_request import grammar_spec
from workers.values.sampling_params import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def request(is_chat: bool = False, **fields):
    if is_chat:
        return protocol.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                                          "content": "hi"}], **fields})
    return protocol.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


@pytest.mark.parametrize("is_chat", [False, True])
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_schema", '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]{3}"}, GrammarSpec("regex", "[0-9]{3}")),
    ({"guided_choice": ["yes", "no"]}, GrammarSpec("choice", '["yes", "no"]')),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, GrammarSpec("grammar", 'root ::= "yes" | "no"')),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"choice": ["a"], "regex": None}}, GrammarSpec("choice", '["a"]')),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_schema", '{"type": "object"}')),
    ({"guided_regex": "[a-z]+", "guided_decoding_backend": "auto"}, GrammarSpec("regex", "[a-z]+")),
])
def test_every_spelling_becomes_one_grammar(is_chat, fields, expected):
    assert grammar_spec(request(is_chat, **fields)) == expected


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_regex", "set one structured-output constraint"),
    ({"guided_json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}, "guided_json",
     'Unimplemented keys: ["if", "then"]'),
    ({"guided_json": {"type": "string", "format": "postcode"}}, "guided_json", "Unknown format: postcode"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "must be a JSON schema"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"structured_outputs": ["json"]}, "structured_outputs", "must be an object"),
    ({"guided_regex": "[0-9]{3"}, "guided_regex", "unclosed counted repetition"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strictly": True}}},
     "response_format", "unknown fields: strictly"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "must be"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "x"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs", "must be a string"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as raised:
        grammar_spec(request(**fields))
    error = raised.value.body()["error"]
    assert raised.value.status_code == 400 and error["param"] == param and words in error["message"], error
