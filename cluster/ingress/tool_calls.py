"""Tools on /v1/chat/completions (pure: the tokenizer is passed in).

    tool_choice "none"          the model answers in text
    a named function            the answer is generated under that function's parameter schema: it is the call's
                                `arguments` (finish_reason "stop", as OpenAI answers a forced call)
    "required"                  under {"name": one of the functions, "arguments": its parameters} (a Lark
                                grammar holding each schema whole, so its own $refs resolve): one call
                                (finish_reason "tool_calls")
    "auto" (the default with tools)   the model decides, in its own tool-call format: a chat template that renders
                                tools and writes calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>
                                (Hermes' format: Qwen 2.5 and 3 among others) is read; the answer's text is
                                buffered and sent once complete. Templates without a tool format (SmolLM2's,
                                Gemma 3's) or with another one are a 400 saying so

The model learns of the tools through its template when the template takes them, else through a system message
listing their schemas. A call in an earlier assistant message, and a `tool` message with its result, are rendered
the same way.
"""

import json
import re
import uuid
from typing import Any

from cluster.ingress.errors import bad_request
from workers.values.grammar import JSON_LAYOUT
from workers.values.sampling_params import GrammarSpec

HERMES_OPEN = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_choice(req) -> str | None:
    """"none", "auto", "required" or a function's name; None when the request has no tools."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in req.tools]
    if len(set(names)) < len(names):
        raise bad_request("tools name the same function twice", "tools")
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"tool_choice must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                              f"naming one of tools' functions, got {choice!r}", "tool_choice")
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
    rules = ["start: " + " | ".join(f"call{i}" for i in range(len(functions)))]
    for i, (name, parameters) in enumerate(functions.items()):
        head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
        rules.append(f"call{i}: {head} arguments{i} " + json.dumps("}"))
        rules.append(f"arguments{i}: %json " + json.dumps({**parameters, "x-guidance": JSON_LAYOUT}))
    return GrammarSpec("grammar", "\n".join(rules))


def template_messages(req, messages: list[dict], tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The messages (and tools) to hand the chat template: as they are when it takes tools, else with the tools
    listed in a system message and calls written as JSON; a 400 for "auto" without a tool format read here."""
    choice = tool_choice(req)
    template = getattr(tokenizer, "chat_template", None) or ""
    takes_tools = "tools" in template
    if choice == "auto" and not (takes_tools and HERMES_OPEN in template):
        why = ("its tool-call format is not one this server reads (Hermes' <tool_call> JSON)" if takes_tools
               else "it has no tool-call format")
        raise bad_request(f"tool_choice \"auto\" lets the model call tools in its own format, and this model's chat "
                          f"template: {why}; use tool_choice \"required\" or name a function", "tool_choice")
    if takes_tools:  # calls' arguments as objects, as templates expect them (Qwen 2.5's would encode text again)
        return ([{**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]} if m.get("tool_calls")
                 else m for m in messages], [tool.model_dump() for tool in req.tools] if req.tools else None)
    rendered = [_as_text(message) for message in messages]
    if req.tools and choice != "none":
        listing = ("You can call these functions (answer with the call as JSON): "
                   + json.dumps([tool.model_dump()["function"] for tool in req.tools]))
        if rendered and rendered[0]["role"] == "system":  # one system turn: some templates allow no second
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{listing}"}
        else:
            rendered.insert(0, {"role": "system", "content": listing})
    return rendered, None


def calls_of(choice: str, text: str) -> list[dict] | None:
    """OpenAI's `tool_calls` of an answer: for a forced call (generated under `tool_grammar`) the call, None when it
    ran out of tokens; under "auto" the Hermes-format calls in the text, None when it has none."""
    if choice == "auto":
        found = [_hermes_call(block) for block in HERMES_CALL.findall(text)]
        calls = [call for call in found if call is not None]
        return [_call(name, arguments) for name, arguments in calls] or None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [_call(parsed["name"], parsed["arguments"]) if choice == "required" else _call(choice, parsed)]


def text_besides_calls(choice: str, text: str) -> str | None:
    """Under "auto", the answer's text outside its calls (None when there is none); a forced call has no text."""
    if choice != "auto":
        return None
    rest = HERMES_CALL.sub("", text).strip()
    return rest or None


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _hermes_call(block: str) -> tuple[str, Any] | None:
    try:
        parsed = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    return parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))


def _functions(req) -> dict[str, dict[str, Any]]:
    """Each tool's name -> its parameter schema (an empty object when it declares none)."""
    return {tool.function.name: tool.function.parameters or {"type": "object", "properties": {}}
            for tool in req.tools or ()}


def _with_object_arguments(call: dict) -> dict:
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.loads(function.get("arguments") or "{}")}}


def _as_text(message: dict) -> dict:
    """A message for a template without tool support: calls as JSON text, a tool's result as a user turn (templates
    that know no tool role, Gemma 3's among them, refuse one)."""
    if message.get("tool_calls"):
        calls = [{"name": call["function"]["name"], "arguments": json.loads(call["function"].get("arguments") or "{}")}
                 for call in message["tool_calls"]]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
    if message["role"] == "tool":
        return {"role": "user", "content": f"The call returned: {message.get('content') or ''}"}
    return {"role": message["role"], "content": message.get("content") or ""}
