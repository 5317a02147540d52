"""Streaming detokenization with the real SmolLM2 tokenizer."""

from cluster.ingress.text_stream import TextStream


def _stream_all(tokenizer, text: str, stop=()) -> tuple[str, list[str]]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stop)
    deltas = [stream.push([token]) for token in ids]
    deltas.append(stream.finish())
    return stream.text, [d for d in deltas if d]


def test_deltas_join_to_the_decoded_text(smollm2_tokenizer):
    text = "Hello there, how are you? Ünïcödé and emoji 🎉 work too."
    full, deltas = _stream_all(smollm2_tokenizer, text)
    assert full == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_stop_string_cuts_the_text_and_is_never_sent(smollm2_tokenizer):
    full, deltas = _stream_all(smollm2_tokenizer, "one two three STOP four five", stop=("STOP",))
    assert full == "one two three "
    assert "".join(deltas) == full
    assert not any("ST" in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer):
    full, _ = _stream_all(smollm2_tokenizer, "alpha beta gamma delta", stop=("delta", "beta"))
    assert full == "alpha "


def test_special_tokens_are_not_shown(smollm2_tokenizer):
    stream = TextStream(smollm2_tokenizer)
    ids = smollm2_tokenizer("Hi", add_special_tokens=False)["input_ids"] + [smollm2_tokenizer.eos_token_id]
    stream.push(ids)
    stream.finish(is_stop=True)
    assert stream.text == "Hi"
