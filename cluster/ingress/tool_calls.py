"""Tools on /v1/chat/completions (pure: the tokenizer is passed in).

    tool_choice "none"          the model answers in text
    a named function            the answer is generated under that function's parameter schema: it is the call's
                                `arguments` (finish_reason "stop", as OpenAI answers a forced call)
    "required"                  under {"name": one of the functions, "arguments": its parameters}: one call
                                (finish_reason "tool_calls")
    "auto" (the default with tools)   needs the model's own tool-call format in its chat template; SmolLM2's and
                                Gemma 3's templates have none, and the answer is a 400 saying so

The model learns of the tools through its template when the template takes them, else through a system message
listing their schemas. A call in an earlier assistant message, and a `tool` message with its result, are rendered
the same way.
"""

import json
import uuid
from typing import Any

from cluster.ingress.errors import bad_request
from workers.sampling_params import GrammarSpec


def tool_choice(req) -> str | None:
    """"none", "auto", "required" or a function's name; None when the request has no tools."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in _functions(req):
            raise bad_request(f"tool_choice names no function of tools: {name!r}", "tool_choice")
        return name
    if choice not in ("none", "auto", "required"):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    return choice


def tool_grammar(req) -> GrammarSpec | None:
    """The constraint a forced call is generated under (None for "none", "auto" or no tools)."""
    choice = tool_choice(req)
    functions = _functions(req)
    if choice in (None, "none", "auto"):
        return None
    if choice != "required":
        return GrammarSpec("json_schema", json.dumps(functions[choice]))
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, parameters in functions.items()]
    return GrammarSpec("json_schema", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}))


def template_messages(req, messages: list[dict], tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The messages (and tools) to hand the chat template: as they are when it takes tools, else with the tools
    listed in a system message and calls written as JSON; a 400 for "auto" without the model's own format."""
    choice = tool_choice(req)
    takes_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
    if choice == "auto":
        raise bad_request("tool_choice \"auto\" needs a model whose chat template has its own tool-call format; "
                          "this model's has none: use tool_choice \"required\" or name a function", "tool_choice")
    if takes_tools:
        return messages, [tool.model_dump() for tool in req.tools] if req.tools else None
    rendered = [_as_text(message) for message in messages]
    if req.tools and choice != "none":
        listing = json.dumps([tool.model_dump()["function"] for tool in req.tools])
        rendered.insert(0, {"role": "system", "content": f"You can call these functions (answer with the call as "
                                                         f"JSON): {listing}"})
    return rendered, None


def calls_of(choice: str, text: str) -> list[dict] | None:
    """OpenAI's `tool_calls` for an answer generated under `tool_grammar`; None when it is not a complete call
    (it ran out of tokens)."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    if choice == "required":
        name, arguments = parsed["name"], parsed["arguments"]
    else:
        name, arguments = choice, parsed
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}]


def _functions(req) -> dict[str, dict[str, Any]]:
    """Each tool's name -> its parameter schema (an empty object when it declares none)."""
    return {tool.function.name: tool.function.parameters or {"type": "object", "properties": {}}
            for tool in req.tools or ()}


def _as_text(message: dict) -> dict:
    """A message for a template without tool support: calls as JSON text, a tool's result as its content."""
    if message.get("tool_calls"):
        calls = [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"] or "{}")}
                 for call in message["tool_calls"]]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
    return {"role": message["role"], "content": message.get("content") or ""}
