"""How a policy writes a tool call and how the answer comes back: one format per chat template.

A format is two pairs of markers. The policy opens a call, writes its argument, and closes it;
the close marker is a stop string of the engine, so generation pauses right after it (the
stop token is kept: it is a policy token). The tool's answer is then inserted as
``result_open + text + result_close`` (tool tokens), and the policy continues after it.

- ``tags`` (the embedded arithmetic task, our SentencePiece tokenizer, where each marker is one
  user-defined piece): ``<calc>347*829</calc><result>287663</result>``; the tool is named by the
  format's ``default_tool``.
- ``hermes`` (Qwen2.5 / Qwen3 chat templates, whose tokenizers have ``<tool_call>`` and
  ``<tool_response>`` as added tokens): ``<tool_call>{"name": "python", "arguments": {"code":
  "..."}}</tool_call>`` answered by ``<tool_response>...</tool_response>``; the JSON names the tool
  and its argument (the first string value of ``arguments``).

A call is the text between the last ``call_open`` and the final ``call_close`` of the turn;
a turn that stopped on ``call_close`` without an opener, or with JSON that does not parse (too
deeply nested included: the policy's text is hostile, and a few thousand ``[`` make the decoder
raise RecursionError), is a malformed call: the answer is an error text, as for a failing tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["FORMATS", "RESULT_PAD", "CallFormat", "ParsedCall", "pad_result"]

RESULT_PAD = "_"
"""What fills a tool's answer up to tools.result_width (one piece of the embedded task's tokenizer)."""


def pad_result(text: str, width: int) -> str:
    """`text` right-padded with RESULT_PAD to `width` characters (unchanged when as long already).

    A small model copies a result into its answer line by distance: the answer's i-th digit looks
    back at the result's i-th digit, and that distance is the width of the result plus the markers
    between them. With a fixed width the distance is one for every result; unpadded, a 4-layer policy
    copied every 5-digit result and no 4-digit one (docs/benchmarks.md, issue 63).
    """
    return text + RESULT_PAD * (width - len(text)) if width > len(text) else text


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call as the policy wrote it."""

    tool: str
    """The tool's name."""
    argument: str
    """Its one argument (an expression, a program)."""
    error: str = ""
    """Why the call is malformed ("" = well formed)."""


@dataclass(frozen=True, slots=True)
class CallFormat:
    """The markers of one call format (module docstring)."""

    name: str
    call_open: str
    call_close: str
    result_open: str
    result_close: str
    json_calls: bool = False
    """The call is ``{"name": ..., "arguments": {...}}`` (hermes); else the raw argument."""
    default_tool: str = "calculator"
    """The tool of a raw-argument call."""

    def parse(self, turn_text: str) -> ParsedCall:
        """The call at the end of a turn that stopped on call_close."""
        body_end = turn_text.rfind(self.call_close)
        start = turn_text.rfind(self.call_open, 0, body_end if body_end >= 0 else len(turn_text))
        if body_end < 0 or start < 0:
            return ParsedCall("", "", f"a call ends with {self.call_close} but does not open with {self.call_open}")
        body = turn_text[start + len(self.call_open):body_end].strip()
        if not self.json_calls:
            return ParsedCall(self.default_tool, body)
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            argument = next(v for v in arguments.values() if isinstance(v, str))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, AttributeError, StopIteration, RecursionError):
            return ParsedCall("", "", 'the call is not {"name": ..., "arguments": {...: "..."}}')
        return ParsedCall(name, argument)

    def answer(self, text: str, width: int = 0) -> str:
        """The text inserted after a call (the tool's tokens), `text` padded to `width` (pad_result)."""
        return f"{self.result_open}{pad_result(text, width)}{self.result_close}"


FORMATS: dict[str, CallFormat] = {
    "tags": CallFormat("tags", "<calc>", "</calc>", "<result>", "</result>"),
    "hermes": CallFormat("hermes", "<tool_call>", "</tool_call>", "<tool_response>\n", "\n</tool_response>",
                         json_calls=True, default_tool="python"),
}
"""The documented formats by name (tools.format)."""
