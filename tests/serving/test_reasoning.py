"""Reasoning output (``app/serving/reasoning.py``): the whole text's split by each parser, and the streamed deltas
joining into it whatever the chunking (tags split between deltas included)."""

from __future__ import annotations

import random

import pytest

from app.serving.reasoning import ReasoningParser

# text -> (reasoning, answer) under deepseek_r1, under qwen3
SPLITS = [
    ("<think>\nAdd them.\n</think>\n\n5", ("\nAdd them.\n", "\n\n5"), ("\nAdd them.\n", "\n\n5")),
    ("Add them.</think>5", ("Add them.", "5"), (None, "Add them.</think>5")),  # opened by R1's prompt
    ("5", ("5", None), (None, "5")),  # no tags: R1 still reasons; Qwen3 with thinking off answers
    ("<think>cut short by max_tokens", ("cut short by max_tokens", None), ("cut short by max_tokens", None)),
    ("<think></think>", (None, None), (None, None)),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),  # the first end tag ends reasoning
    ("<thin", ("<thin", None), (None, "<thin")),  # a start of the tag, not the tag
    ("", (None, None), (None, None)),
    ("x<think>y</think>z", ("x<think>y", "z"), (None, "x<think>y</think>z")),  # the tag opens the output or nothing
]


@pytest.mark.parametrize("text,r1,qwen3", SPLITS, ids=[repr(t)[:30] for t, _, _ in SPLITS])
def test_whole_text_splits_as_each_parser_reads_it(text, r1, qwen3):
    assert ReasoningParser("deepseek_r1").split(text) == r1
    assert ReasoningParser("qwen3").split(text) == qwen3


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", [t for t, _, _ in SPLITS])
def test_streamed_deltas_join_into_the_whole_text_s_parts(name, text):
    parser = ReasoningParser(name)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), k=min(rng.randint(0, 4), max(len(text) - 1, 0))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, reasoning, answer = parser.stream(), "", ""
        for piece in pieces:
            r, a = stream.feed(piece)
            reasoning, answer = reasoning + r, answer + a
        r, a = stream.finish()
        reasoning, answer = reasoning + r, answer + a
        assert (reasoning or None, answer or None) == parser.split(text), pieces


def test_reasoning_streams_at_once_and_waits_only_on_a_possible_tag():
    stream = ReasoningParser("qwen3").stream()
    assert stream.feed("<thi") == ("", "")  # maybe the start tag
    assert stream.feed("nk>Let me see") == ("Let me see", "")
    assert stream.feed(" now</th") == (" now", "")  # "</th" may become the end tag
    assert stream.feed("ink>\n\nIt is") == ("", "\n\nIt is")
    assert stream.feed(" 5.") == ("", " 5.") and stream.finish() == ("", "")
    plain = ReasoningParser("qwen3").stream()
    assert plain.feed("It is 5") == ("", "It is 5")  # not opened: the answer, at once


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_an_output_continuing_a_started_message_starts_where_it_left_off(name):
    """``continue_final_message``: after a prefill that opened ``<think>``, the output reasons up to ``</think>``;
    after one that closed it (or has no tag), it is the answer, streamed or not."""
    for prefill, text, parts in (("<think>Let me", " see.</think>4", (" see.", "4")),
                                 ("<think>I know.</think>The answer", " is 4.", (None, " is 4.")),
                                 ("The answer", " is 4.", (None, " is 4.")),
                                 ("<think>a</think>b<think>c", " d</think>e", (" d", "e"))):
        parser = ReasoningParser(name, prefill)
        assert parser.split(text) == parts, prefill
        stream = parser.stream()
        pieces = [stream.feed(c) for c in text] + [stream.finish()]
        assert ("".join(r for r, _ in pieces) or None, "".join(a for _, a in pieces) or None) == parts, prefill
