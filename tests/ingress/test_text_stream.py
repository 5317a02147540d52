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


class CountingTokenizer:
    """The real tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_decoded_ids = 0

    def decode(self, token_ids, **kwargs) -> str:
        self.num_decoded_ids += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def test_a_long_answer_streams_exactly_with_work_linear_in_its_length(smollm2_tokenizer):
    text = " ".join(f"línea {i}: ✓ 日本語 🎉 ok." for i in range(150))
    ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    counting = CountingTokenizer(smollm2_tokenizer)
    stream = TextStream(counting, stop=("never here",))
    deltas = [stream.push([token]) for token in ids] + [stream.finish()]
    assert "".join(deltas) == stream.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)
    # Each push decodes a window of a few tokens, not the whole answer (which would be ~len(ids)^2 / 2).
    assert len(ids) > 2000 and counting.num_decoded_ids < 20 * len(ids)


def test_a_stop_string_split_across_pushes_and_characters_is_cut(smollm2_tokenizer):
    full, deltas = _stream_all(smollm2_tokenizer, "fine 👍👍👍 and more text", stop=("👍👍👍",))
    assert full == "fine " and "".join(deltas) == full


def test_half_a_character_waits_for_the_rest_and_an_answer_cut_inside_one_ends_as_decoded(smollm2_tokenizer):
    word = smollm2_tokenizer("ok", add_special_tokens=False)["input_ids"]
    emoji = smollm2_tokenizer(" 🎉", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1  # several byte tokens
    stream = TextStream(smollm2_tokenizer)
    assert stream.push(word) == "ok"
    assert stream.push(emoji[:-1]) == ""  # half a character: nothing yet
    assert stream.push(emoji[-1:]) == " 🎉"
    cut = TextStream(smollm2_tokenizer)
    cut.push(word + emoji[:-1])
    assert cut.text + cut.finish() == smollm2_tokenizer.decode(word + emoji[:-1])  # the answer ended mid-character
