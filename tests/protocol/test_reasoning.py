"""A reasoning model's output splits into thinking and content the same way whole or streamed."""

from __future__ import annotations

import random

import pytest

from pagedbatch.protocol.reasoning import ReasoningSplitter, ReasoningStream, Split

START, END = "<think>", "</think>"
START_ID, END_ID = 6, 7


def splitter(starts_inside: bool) -> ReasoningSplitter:
    return ReasoningSplitter(START, END, END_ID, starts_inside, START_ID)


@pytest.mark.parametrize(
    ("starts_inside", "text", "expected"),
    [
        # The prompt opened the thinking (DeepSeek-R1's templates).
        (True, "let me see</think>Paris.", Split("let me see", "Paris.")),
        (True, "</think>Paris.", Split("", "Paris.")),
        (True, "still thinking when cut", Split("still thinking when cut", None)),
        (True, "done</think>", Split("done", None)),
        (True, "a</think>b</think>c", Split("a", "b</think>c")),
        # The model opens it (Qwen3's), or does not think at all.
        (False, "<think>hmm</think>\n\nParis.", Split("hmm", "\n\nParis.")),
        (False, "\n<think>hmm</think>Paris.", Split("hmm", "Paris.")),
        (False, "Paris.", Split(None, "Paris.")),
        (False, "Paris <think>no</think>", Split(None, "Paris <think>no</think>")),
        (False, "<think>cut short", Split("cut short", None)),
        (False, "", Split(None, "")),
    ],
)
def test_an_output_splits_at_the_tags_as_its_prompt_began(starts_inside, text, expected):
    assert splitter(starts_inside).split(text) == expected


def test_reasoning_tokens_run_through_the_closing_tag_or_to_the_end():
    inside = splitter(True)
    assert inside.reasoning_tokens([1, 2, END_ID, 3], Split("..", ".")) == 3
    assert inside.reasoning_tokens([1, 2, 3], Split("...", None)) == 3
    assert splitter(False).reasoning_tokens([1, 2], Split(None, "..")) == 0


PIECES = [START, END, "a", "b c", " ", "\n", "<", "</", "</thi", "<th", "think>", ">"]


@pytest.mark.parametrize("starts_inside", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_a_stream_sends_what_the_whole_output_holds_and_never_takes_any_back(starts_inside, seed):
    rng = random.Random(seed)
    pieces = [rng.choice(PIECES) for _ in range(rng.randrange(1, 12))]
    if not starts_inside and rng.random() < 0.5:
        pieces.insert(0, START)
    stream = ReasoningStream(splitter(starts_inside))
    reasoning, content = [], []
    for i, piece in enumerate(pieces):
        sent = stream.feed(piece, [], finished=i == len(pieces) - 1)
        reasoning.append(sent.reasoning or "")
        content.append(sent.content or "")
    whole = splitter(starts_inside).split("".join(pieces))
    assert "".join(reasoning) == (whole.reasoning or "")
    assert "".join(content) == (whole.content or "")


def test_a_tag_arriving_in_pieces_is_held_until_it_is_whole():
    stream = ReasoningStream(splitter(True))
    assert stream.feed("step one</thi", [1, 2], finished=False) == Split("step one", None)
    assert stream.feed("nk>Answer", [END_ID, 3], finished=False) == Split(None, "Answer")
    assert stream.reasoning_tokens() == 3


def test_an_output_that_may_still_open_its_thinking_sends_nothing_yet():
    stream = ReasoningStream(splitter(False))
    assert stream.feed("\n", [1], finished=False) == Split(None, None)
    assert stream.feed("<think>", [2], finished=False) == Split(None, None)
    assert stream.feed("x", [3], finished=False) == Split("x", None)


@pytest.mark.parametrize(
    ("prompt", "after"),
    [
        ([1, 2, START_ID, 3], END_ID),  # the prompt opened the thinking (R1's templates)
        ([1, 2, 3], END_ID),  # the model may open it (Qwen3's): the answer comes after it
        ([1, START_ID, 3, END_ID, 4], None),  # closed (thinking switched off): at once
        ([1, START_ID, END_ID, 2, START_ID, 3], END_ID),  # an earlier turn's, then a new one
    ],
)
def test_a_grammar_starts_after_the_thinking_unless_the_prompt_closed_it(prompt, after):
    """vLLM's `reasoning_ended`: the prompt's last thinking tag decides."""
    assert splitter(False).grammar_starts_after(prompt) == after
