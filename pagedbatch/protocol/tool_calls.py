"""Tool calls in a model's text: the shape of one, for the grammar that enforces it, and the
parsing of an output back into its text and its calls.

A call is written exactly as the chat template (pagedbatch/demo_tokenizer.py, Qwen2.5's layout)
renders one from the history, so the model writes them the way it reads them:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one call per line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedbatch.engine.sample.structured_output import StructuredOutput

TOOL_CALL_START = "<tool_call>\n"
TOOL_CALL_END = "}\n</tool_call>"
TOOL_CALL_OPENING = TOOL_CALL_START.strip()  # what opens a call in free text
_SEPARATOR = "\n"
_BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def call_tag(name: str, arguments: StructuredOutput) -> dict[str, Any]:
    """One call to function `name` whose arguments follow `arguments` (a structural tag)."""
    return {
        "type": "tag",
        "begin": f'{TOOL_CALL_START}{{"name": {json.dumps(name)}, "arguments": ',
        "content": {"type": "grammar", "grammar": arguments.grammar},
        "end": TOOL_CALL_END,
    }


def calls_in_a_row(call: dict[str, Any], most: int) -> dict[str, Any]:
    """One to `most` of `call` (a structural-tag format), one per line."""
    if most == 1:
        return call
    another = {
        "type": "sequence",
        "elements": [{"type": "const_string", "value": _SEPARATOR}, call],
    }
    more = {"type": "repeat", "min": 0, "max": most - 1, "content": another}
    return {"type": "sequence", "elements": [call, more]}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI's tool_calls carry it


def parse_tool_calls(text: str, complete: bool = True) -> tuple[str | None, list[ToolCall]]:
    """Split an output into its text (None if blank) and its tool calls, in order.

    A block that is not a well-formed call (only possible in unconstrained text) stays text.
    With `complete=False`, `text` is an output still growing: the text returned is the part that
    can no longer turn into a call, so a stream can send it at once. Each such text is a prefix of
    the next and of the final one, so streamed pieces join into exactly the final text.
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for block in _BLOCK.finditer(text):
        try:
            call = json.loads(block.group(1))
            calls.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[position : block.start()])
        position = block.end()
    tail = text[position:]
    if not complete:
        tail = _settled(tail)
    kept.append(tail)
    content = "".join(kept)
    if complete:
        return content.strip() or None, calls
    # Leading blanks go only if text follows them; trailing ones wait to see what follows.
    return content.lstrip().rstrip(), calls


def _settled(tail: str) -> str:
    """The part of a growing output's tail that no call can take back: everything before an
    opened call, or before a trailing piece that may yet open one."""
    opened = tail.find(TOOL_CALL_OPENING)
    if opened >= 0:
        return tail[:opened]
    for keep in range(len(TOOL_CALL_OPENING) - 1, 0, -1):
        if tail.endswith(TOOL_CALL_OPENING[:keep]):
            return tail[:-keep]
    return tail
