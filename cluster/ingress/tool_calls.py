"""Tools on /v1/chat/completions (pure: the tokenizer is passed in).

    tool_choice "none"          the model answers in text
    a named function            the answer is generated under that function's parameter schema: it is the call's
                                `arguments` (finish_reason "stop", as OpenAI answers a forced call)
    "required"                  under {"name": one of the functions, "arguments": its parameters} (a Lark
                                grammar holding each schema whole, so its own $refs resolve): a list of one
                                or more such calls, or one under parallel_tool_calls false (finish_reason
                                "tool_calls")
    "auto" (the default with tools)   the model decides, in its own tool-call format, read by the configured
                                `--tool-call-parser` (`cluster.ingress.tool_parsers`: hermes, llama3_json, mistral,
                                qwen3_coder), or without one by the hermes parser when the template writes
                                <tool_call> tags (Qwen 2.5 and 3 among others); streamed, the text besides the
                                calls comes as content and each call as OpenAI streams one
                                (`cluster.ingress.tool_call_stream`). A template that takes no tools
                                (SmolLM2's, Gemma 3's), or no parser for its format, is a 400 saying so

The model learns of the tools through its template when the template takes them, else through a system message
listing their schemas. A call in an earlier assistant message, and a `tool` message with its result, are rendered
the same way.
"""

import json
import uuid
from typing import Any

from cluster.ingress.errors import bad_request
from cluster.ingress.json_members import scan_object
from cluster.ingress.tool_parsers import TOOL_PARSERS, call_so_far, list_items, parser_for
from workers.values.grammar import JSON_LAYOUT
from workers.values.sampling_params import GrammarSpec



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
    calls = " | ".join(f"call{i}" for i in range(len(functions)))
    # One call, or under parallel calls (OpenAI's default) a list of one or more, as vLLM's "required" is.
    rules = [f"start: {calls}"] if req.parallel_tool_calls is False else ['start: "[" call (", " call)* "]"',
                                                                        f"call: {calls}"]
    for i, (name, parameters) in enumerate(functions.items()):
        head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
        rules.append(f"call{i}: {head} arguments{i} " + json.dumps("}"))
        rules.append(f"arguments{i}: %json " + json.dumps({**parameters, "x-guidance": JSON_LAYOUT}))
    return GrammarSpec("grammar", "\n".join(rules))


def auto_parser(req, tokenizer, configured: str | None) -> str | None:
    """The tool parser that reads an "auto" answer (None for any other tool_choice); a 400 when the chat template
    takes no tools, or no parser is configured and it writes no Hermes tags."""
    if tool_choice(req) != "auto":
        return None
    template = getattr(tokenizer, "chat_template", None) or ""
    parser = parser_for(configured, template) if "tools" in template else None
    if parser is None:
        why = ("its tool-call format is not Hermes' <tool_call> tags, and no --tool-call-parser is set ("
               f"{', '.join(TOOL_PARSERS)})" if "tools" in template
               else "it has no tool-call format (it renders no tools)")
        raise bad_request(f"tool_choice \"auto\" lets the model call tools in its own format, and this model's chat "
                          f"template: {why}; use tool_choice \"required\" or name a function", "tool_choice")
    return parser.name


def template_messages(req, messages: list[dict], tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The messages (and tools) to hand the chat template: as they are when it takes tools, else with the tools
    listed in a system message and calls written as JSON."""
    choice = tool_choice(req)
    template = getattr(tokenizer, "chat_template", None) or ""
    takes_tools = "tools" in template
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


def calls_of(choice: str, text: str, parser: str | None = None) -> list[dict] | None:
    """OpenAI's `tool_calls` of an answer, each call's arguments the JSON text the model wrote: for a forced call
    (generated under `tool_grammar`) the call, its arguments cut short as they came when the limit cut it (as OpenAI
    returns such a call, with finish_reason "length"); under "auto" the calls `parser` reads in the text, None when
    it has none."""
    if choice == "auto":
        calls = TOOL_PARSERS[parser or "hermes"].calls(text)
        return None if calls is None else [_raw_call(name, arguments) for name, arguments in calls]
    if choice == "required":
        return _required_calls(text)
    return [_raw_call(choice, text)] if text.strip() else None  # the whole answer is its arguments, cut or not


def text_besides_calls(choice: str, text: str, parser: str | None = None) -> str | None:
    """Under "auto", the answer's text outside its calls (None when there is none); a forced call has no text."""
    if choice != "auto":
        return None
    return TOOL_PARSERS[parser or "hermes"].besides(text)


def _raw_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[dict] | None:
    """The calls a "required" answer holds, whole or as far as they came when the limit cut them: one
    {"name": ..., "arguments": ...} object, or under parallel calls a list of them."""
    if not text.lstrip().startswith("["):
        return [_required_call(text)] if text.strip() else None
    calls = [_required_call(item) for item in list_items(text)]  # the last one whole or as far as it came
    if len(calls) > 1 and not calls[-1]["function"]["name"]:
        calls.pop()  # the limit cut it before its name came
    return calls or None


def _required_call(text: str) -> dict:
    """One call object as the grammar writes it, {"name": ..., "arguments": first; cut short, its name is known once
    its string closed (empty before) and its arguments are what came, as the stream reads them."""
    call = call_so_far(text, scan_object(text))
    return _raw_call("", "") if call is None else _raw_call(*call)


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
    kept = {key: message[key] for key in ("name", "reasoning_content") if key in message}
    return {**kept, "role": message["role"], "content": message.get("content") or ""}
