"""Reasoning split from the answer by the think tags, whole and streamed in any cut, as vLLM's parsers name them."""

import pytest

from cluster.ingress.reasoning import ReasoningStream, split_reasoning


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "\n\nIt is 4."),
    ("qwen3", "  <think>hm</think>ok", "hm", "ok"),
    ("qwen3", "It is 4.", None, "It is 4."),  # thinking off: no block, all answer
    ("qwen3", "a <think>b</think>", None, "a <think>b</think>"),  # the tag opens a block only at the start
    ("qwen3", "<think>cut by max_tok", "cut by max_tok", ""),  # never closed: all reasoning
    ("qwen3", "<thi", None, "<thi"),
    ("deepseek_r1", "First, 2+2.</think>It is 4.", "First, 2+2.", "It is 4."),
    ("deepseek_r1", "<think>First.</think>4", "First.", "4"),  # the tag the template opened, written again
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
    ("deepseek_r1", "</think>", "", ""),
])
def test_a_whole_answer_splits_into_reasoning_and_content(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)


@pytest.mark.parametrize("parser, text", [
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4."), ("qwen3", " plain <answer> with < signs"),
    ("qwen3", "<think>a</thinker>b</think>c"), ("deepseek_r1", "<think>x</think>y</think>z"),
    ("deepseek_r1", "a<b</thin</think>done"),
])
def test_a_stream_in_any_cut_joins_to_the_whole_split(parser, text):
    whole_reasoning, whole_content = split_reasoning(parser, text)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            stream = ReasoningStream(parser)
            reasoning, content = stream.push(text[:cut])
            for start in range(cut, len(text), step):
                more = stream.push(text[start:start + step])
                reasoning, content = reasoning + more[0], content + more[1]
            tail = stream.finish()
            assert (reasoning + tail[0], content + tail[1]) == (whole_reasoning or "", whole_content), (cut, step)


def test_a_closing_tag_split_across_deltas_never_shows():
    stream = ReasoningStream("deepseek_r1")
    assert stream.push("think </th") == ("think ", "")  # "</th" may be the tag: held back
    assert stream.push("ink>answer") == ("", "answer")


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'.*qwen3, deepseek_r1"):
        ReasoningStream("granite")
