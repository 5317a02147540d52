"""Malformed (and oddly valid) OpenAI request bodies for the service's fuzz test, seeded by the caller."""

import json
import random


_ODD_TEXT = ["\ud800", "\udfff lone", "\x00\x01\x7f", "\u202eevil", "\U0001d518\U0001d52b\U0001d526", "e\u0301" * 50,
             "\ufeff", "\U0001f600" * 30, "\n" * 40, "\u0000"]
_ODD_VALUES = [None, True, False, 0, -1, 1.5, 10**30, -10**30, 1e308, -1e308, 2**63, "", "7", "NaN", [], {}, ["x"],
               {"role": "user"}, [None], "\ud800"]
_NUMBER_FIELDS = ["max_tokens", "temperature", "top_p", "seed", "n", "priority", "forced_output_tokens",
                  "max_completion_tokens", "presence_penalty", "logprobs", "frequency_penalty", "top_k", "min_p",
                  "repetition_penalty", "min_tokens", "best_of", "top_logprobs"]


def fuzz_body(rng: random.Random, is_chat: bool, model: str) -> bytes:
    """One malformed (or oddly valid) request body: a valid one with one thing broken."""
    body = {"model": model, "max_tokens": 2, "temperature": 0}
    if is_chat:
        body["messages"] = [{"role": "user", "content": "Say hi."}]
    else:
        body["prompt"] = "Say hi."
    kind = rng.choice(["type", "missing", "unknown", "unicode", "number", "broken", "nested", "constant", "choices"])
    fields = list(body) + ["stream", "stop", "stream_options", "user", "logit_bias", "stop_token_ids", "n", "echo",
                           "logprobs", "best_of", "top_logprobs", "tools", "tool_choice", "response_format",
                           "guided_json"]
    if kind == "type":
        body[rng.choice(fields)] = rng.choice(_ODD_VALUES)
    elif kind == "missing":
        body.pop(rng.choice(list(body)))
    elif kind == "unknown":
        body[rng.choice(["foo", "\u00fc\u00f1\u00ee", "x" * 300, ""])] = rng.choice(_ODD_VALUES)
    elif kind == "unicode":
        text = rng.choice(_ODD_TEXT)
        if is_chat:
            body["messages"] = [{"role": rng.choice(["user", "system", "\ud800", "tool"]), "content": text}]
        else:
            body["prompt"] = rng.choice([text, [text], [[1, 2, 3]], [text, 5]])
    elif kind == "number":
        body[rng.choice(_NUMBER_FIELDS)] = rng.choice([10**30, -10**30, 1e308, -1e308, 2**63, -1, 0, 1e-300])
    elif kind == "choices":  # scoring and several choices, combined in ways valid and not
        body.update({"n": rng.choice([1, 2, 3]), "stream": rng.random() < 0.3})
        if is_chat:
            body.update({"logprobs": rng.choice([True, False, None]), "top_logprobs": rng.choice([None, 0, 2, 20, 21])})
        else:
            body.update({"echo": rng.choice([True, False]), "logprobs": rng.choice([None, 0, 3, 20, 21]),
                         "best_of": rng.choice([None, 1, 2, 4]), "max_tokens": rng.choice([0, 1, 2]),
                         "prompt": rng.choice(["Say hi.", ["a", "b"], [[1, 2], [3]], [[5] * 3] * 30])})
    elif kind == "nested":
        deep = "x"
        for _ in range(rng.choice([10, 200, 500])):
            deep = [deep]
        body["messages" if is_chat else "prompt"] = deep
    encoded = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if kind == "broken":
        choice = rng.randrange(6)
        if choice == 0:
            return encoded[: rng.randrange(len(encoded))]
        if choice == 1:
            return encoded + b"}garbage"
        if choice == 2:
            return b"\xff\xfe" + encoded
        if choice == 3:
            return encoded.replace(b":", b"=", 1)
        if choice == 4:
            return b""
        return b'{"model": "' + model.encode() + b'", "max_tokens": NaN, "prompt": "hi"}'
    if kind == "constant":
        return rng.choice([b"Infinity", b"[]", b"null", b"1e999", b'"' + b"a" * 1000 + b'"', b"{" * 5000,
                           b"[" * 30000 + b"]" * 30000])
    return encoded
