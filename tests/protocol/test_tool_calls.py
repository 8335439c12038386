"""Tool calls read back out of a model's text, whole or while it grows."""

import pytest

from pagedbatch.protocol.tool_calls import ToolCall, parse_tool_calls


def test_tool_calls_parse_into_openai_shape():
    text = (
        'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    assert parse_tool_calls(text) == (
        "Checking.",
        [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}")],
    )
    assert parse_tool_calls("no calls") == ("no calls", [])
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])


@pytest.mark.parametrize(
    "text",
    [
        ' Checking. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool"}}\n</tool_call> ok <',
        "<tool_call>\nnot json\n</tool_call> then text",
        'a <tool_call>\n{"name": ',  # cut off mid-call: text in the end
        "  \n plain text, with a < and a <tool but no call  ",
    ],
)
def test_a_growing_output_settles_into_exactly_its_final_split(text):
    final_content, final_calls = parse_tool_calls(text)
    sent_content, sent_calls = "", []
    for end in range(len(text) + 1):
        content, calls = parse_tool_calls(text[:end], complete=False)
        # What a stream sent is never taken back, and never shows part of a call.
        assert content.startswith(sent_content) and calls[: len(sent_calls)] == sent_calls
        assert "<tool_call>" not in content
        sent_content, sent_calls = content, calls
    assert (final_content or "").startswith(sent_content) and final_calls == sent_calls
