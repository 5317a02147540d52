"""A request's structured-output constraint, from any of the spellings clients send, as one `GrammarSpec` checked by
the grammar compiler the workers run (an unsupported schema feature is a 400 naming it; pure of torch).

    response_format   OpenAI: {"type": "text"} | {"type": "json_object"}
                      | {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    guided_json, guided_regex, guided_choice, guided_grammar          vLLM's older fields
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   vLLM's newer one

At most one constraint per request.
"""

import json
from typing import Any

from cluster.ingress.errors import bad_request
from cluster.ingress.tool_calls import tool_grammar
from workers.values.grammar import check_grammar
from workers.values.sampling_params import GrammarSpec

ANY_JSON_OBJECT = '{"type": "object"}'
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def grammar_spec(req) -> GrammarSpec | None:
    """The request's constraint, checked; None for free text; APIError (400) naming the field otherwise."""
    found = [(field, spec) for field, spec in _candidates(req) if spec is not None]
    if len(found) > 1:
        raise bad_request(f"set one structured-output constraint, not {' and '.join(f for f, _ in found)}",
                          found[1][0])
    if not found:
        return None
    field, spec = found[0]
    try:
        check_grammar(spec)
    except ValueError as error:
        raise bad_request(f"{field}: {error}", field) from None
    return spec


def _candidates(req):
    yield "response_format", _from_response_format(req.response_format)
    yield "guided_json", None if req.guided_json is None else GrammarSpec("json_schema", _as_json(req.guided_json,
                                                                                                   "guided_json"))
    yield "guided_regex", None if req.guided_regex is None else GrammarSpec("regex", req.guided_regex)
    yield "guided_choice", None if req.guided_choice is None else _choice(req.guided_choice, "guided_choice")
    yield "guided_grammar", None if req.guided_grammar is None else GrammarSpec("grammar", req.guided_grammar)
    yield "structured_outputs", _from_structured_outputs(req.structured_outputs)
    if hasattr(req, "tools"):  # chat: a forced call is generated under its function's parameters
        yield "tool_choice", tool_grammar(req)


def _from_response_format(value: Any) -> GrammarSpec | None:
    if value is None or isinstance(value, dict) and value.get("type") == "text" and len(value) == 1:
        return None
    if not isinstance(value, dict):
        raise bad_request('response_format must be an object such as {"type": "json_object"}', "response_format")
    kind = value.get("type")
    if kind == "json_object" and len(value) == 1:
        return GrammarSpec("json_schema", ANY_JSON_OBJECT)
    if kind == "json_schema":
        described = value.get("json_schema")
        if not isinstance(described, dict) or not isinstance(described.get("schema", {}), dict):
            raise bad_request('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                              "response_format")
        unknown = set(described) - {"name", "schema", "strict", "description"}
        if unknown:
            raise bad_request(f"response_format.json_schema has unknown fields: {', '.join(sorted(unknown))}",
                              "response_format")
        return GrammarSpec("json_schema", json.dumps(described.get("schema", {"type": "object"})))
    raise bad_request('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                      '"json_schema", "json_schema": {...}}', "response_format")


def _from_structured_outputs(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object such as {\"json\": {...}}", "structured_outputs")
    given = {key: item for key, item in value.items() if item not in (None, False)}
    if given.keys() == {"json_object"}:
        return GrammarSpec("json_schema", ANY_JSON_OBJECT)
    if len(given) != 1 or next(iter(given)) not in _STRUCTURED_OUTPUTS_KEYS:
        raise bad_request(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)} or "
                          f"json_object; got {', '.join(sorted(given)) or 'none'}", "structured_outputs")
    key, item = next(iter(given.items()))
    if key == "choice":
        return _choice(item, "structured_outputs")
    if key == "json":
        return GrammarSpec("json_schema", _as_json(item, "structured_outputs"))
    if not isinstance(item, str):
        raise bad_request(f"structured_outputs.{key} must be a string", "structured_outputs")
    return GrammarSpec(_STRUCTURED_OUTPUTS_KEYS[key], item)


def _as_json(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise bad_request(f"{field} is not valid JSON: {error}", field) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{field} must be a JSON schema (an object)", field)
    return json.dumps(schema)


def _choice(choices: Any, field: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{field} must be a non-empty list of non-empty strings", field)
    return GrammarSpec("choice", json.dumps(choices))
