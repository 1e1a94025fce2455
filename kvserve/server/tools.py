"""Tool calling: tool definitions into the prompt, ``<tool_call>`` output back into calls.

Prompting. A chat template that knows tools (its source uses ``tools``, as Qwen2.5's and
Hermes' do) gets the tool definitions and the structured ``tool_calls`` / ``tool`` turns as
they are. A template that does not (SmolLM2's) gets the Hermes convention written into the
messages: the tool signatures in the system prompt inside ``<tools></tools>``, earlier calls
as ``<tool_call>{...}</tool_call>`` in the assistant turn, and tool results as a user turn
of ``<tool_response>...</tool_response>`` blocks (Qwen2.5's rendering).

Parsing (``--tool-call-parser hermes``, vLLM's name): every ``<tool_call>`` block holds a JSON
object ``{"name", "arguments"}`` (or a list of them, as SmolLM2 writes); text outside the
blocks is the message content. Constrained choices (``required`` or a named function) do not
parse free text: their output is generated under a JSON schema (``tool_choice_schema``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.S)

HERMES_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def new_call_id() -> str:
    """A tool-call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


def template_supports_tools(template: str | None) -> bool:
    """True when the Jinja chat template renders ``tools`` itself."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def tools_as_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenAI tool objects (pydantic) as plain dicts, without unset fields."""
    return [t.model_dump(exclude_none=True, by_alias=True) for t in tools]


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` (OpenAI dicts) rewritten as plain role/content turns in the Hermes format,
    for a template that does not render tools itself."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        prompt = HERMES_SYSTEM_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            prompt = messages[0]["content"] + "\n\n" + prompt
            messages = messages[1:]
        out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            payload = {"name": fn["name"], "arguments": _loads_or_text(fn["arguments"])}
            block = f"{START}\n{json.dumps(payload, ensure_ascii=False)}\n{END}"
            content = f"{content}\n{block}" if content else block
        out.append({"role": m["role"], "content": content})
    for m in out:
        m.pop("_tool_results", None)
    return out


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a tool-aware template: arguments as objects (Qwen's and Hermes'
    templates serialise them), content always a string."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _loads_or_text(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# ---- constrained tool choice ----------------------------------------------------------------


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema (an empty object schema when it has none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of ``tool_choice="required"`` output: an array of one (or, with parallel
    calls, one or more) ``{"name", "arguments"}`` objects, each under its function's schema."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": function_parameters(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class RequiredCallSpan:
    """One call of a ``required`` output being written: its name once the name's string has
    closed, and where its ``arguments`` value lies in the text (``args_end`` None while the
    value is still open)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None

    def arguments(self, text: str) -> str:
        """The arguments' JSON text written so far (all of it once closed)."""
        if self.args_start is None:
            return ""
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]


def scan_required_calls(text: str) -> list[RequiredCallSpan]:
    """The calls of a ``required`` output (``[{"name": ..., "arguments": {...}}, ...]``, as
    its schema constrains it), also while it is being written or once cut short: one
    character pass tracking strings and nesting, so a stream can send each call's name as
    soon as it is complete and its arguments as they come."""
    calls: list[RequiredCallSpan] = []
    depth = 0  # 1: inside the array, 2: inside a call object
    in_string = escaped = False
    string_start = 0
    expect = "key"  # in a call object: "key", "colon", "value" or "comma"
    key: str | None = None
    args_depth = 0  # the depth an open container arguments value started at, else 0
    scalar_args = False  # an arguments value that is a bare number / true / false / null

    def close_scalar(at: int) -> None:
        nonlocal scalar_args
        if scalar_args:
            calls[-1].args_end, scalar_args = at, False

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2:
                    value = text[string_start : i + 1]
                    if expect == "key":
                        key, expect = json.loads(value), "colon"
                    else:  # a string value of the call object
                        if key == "name":
                            calls[-1].name = json.loads(value)
                        elif key == "arguments":
                            calls[-1].args_end = i + 1
                        expect = "comma"
            continue
        if ch == '"':
            in_string, string_start = True, i
            if depth == 2 and expect == "value" and key == "arguments":
                calls[-1].args_start = i
        elif ch in "[{":
            if depth == 1 and ch == "{":
                calls.append(RequiredCallSpan())
                expect, key = "key", None
            elif depth == 2 and expect == "value" and key == "arguments":
                calls[-1].args_start, args_depth = i, depth + 1
            depth += 1
        elif ch in "]}":
            if depth == 2:
                close_scalar(i)
            depth -= 1
            if depth == 2 and args_depth == depth + 1:
                calls[-1].args_end, args_depth, expect = i + 1, 0, "comma"
        elif depth == 2:
            if ch == ":":
                expect = "value"
            elif ch == ",":
                close_scalar(i)
                expect = "key"
            elif not ch.isspace() and expect == "value":
                if key == "arguments" and not scalar_args:
                    calls[-1].args_start, scalar_args = i, True
    return calls


def required_calls(text: str) -> list[ParsedCall]:
    """The named calls of a ``required`` output, each with its arguments' JSON text as
    written (cut short too, when max_tokens ended the output, as a named function's)."""
    return [
        ParsedCall(span.name, span.arguments(text))
        for span in scan_required_calls(text)
        if span.name is not None
    ]


# ---- parsing free text ---------------------------------------------------------------------


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content outside the blocks or None, calls) of a whole model output. A block whose
    JSON does not parse stays in the content, so nothing the model wrote is lost."""
    calls: list[ParsedCall] = []
    content_parts: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        parsed = _parse_block(m.group(1))
        content_parts.append(text[pos : m.start()])
        if parsed is None:
            content_parts.append(m.group(0))
        else:
            calls.extend(parsed)
        pos = m.end()
    content_parts.append(text[pos:])
    content = "".join(content_parts).strip()
    return (content or None), calls


def _parse_block(body: str) -> list[ParsedCall] | None:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ParsedCall(item["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls


class StreamingToolParser:
    """Splits a streamed output into content deltas and complete tool calls.

    Text outside ``<tool_call>`` blocks streams as content, except a tail that could be the
    start of the tag (held back until it cannot) and, once a block has opened, trailing
    whitespace (held back until more content follows). Each block is reported as a call once
    its ``</tool_call>`` arrives, or at ``finish()`` if the output ended inside it. The content
    and calls streamed are those of ``parse_tool_calls`` on the whole output (but for the
    whitespace around the text before the first block, which streams as it comes).
    """

    def __init__(self) -> None:
        self.text = ""
        self._pos = 0  # characters of text handled: sent as content, held, or in a block
        self._block_start: int | None = None  # where the open block starts, if one is open
        self._in_calls = False  # a block has opened
        self._held = ""  # whitespace that ended the content so far, not sent yet
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """(content delta, newly completed calls) after ``delta``."""
        self.text += delta
        content, calls = self._closed_blocks()
        if self._block_start is None:
            safe = max(self._pos, len(self.text) - _partial_tag_len(self.text))
            content += self._content(self.text[self._pos : safe])
            self._pos = safe
        return content, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is left once the output is complete: held-back content, an unclosed block."""
        content, calls = self._closed_blocks()
        rest = self.text[self._pos :]
        self._pos = len(self.text)
        if self._block_start is None:
            content += self._content(rest)
        else:
            self._block_start = None
            parsed = _parse_block(rest[len(START) :])
            if parsed is None:
                content += self._content(rest)
            else:
                calls.extend(parsed)
                self.num_calls += len(parsed)
        # NOTE: as ``parse_tool_calls``: the content is stripped only when there are calls.
        if not self.num_calls:
            content, self._held = content + self._held, ""
        return content, calls

    def _closed_blocks(self) -> tuple[str, list[ParsedCall]]:
        """Content before each block that opened and the calls of those that closed since
        the last call; a block whose JSON does not parse is content."""
        content = ""
        calls: list[ParsedCall] = []
        while True:
            if self._block_start is None:
                start = self.text.find(START, self._pos)
                if start < 0:
                    break
                content += self._content(self.text[self._pos : start])
                self._block_start = self._pos = start
                self._in_calls = True
            end = self.text.find(END, self._block_start + len(START))
            if end < 0:
                break
            block = self.text[self._block_start : end + len(END)]
            self._block_start, self._pos = None, end + len(END)
            parsed = _parse_block(block[len(START) : -len(END)])
            if parsed is None:
                content += self._content(block)  # not a call after all: keep the text
            else:
                calls.extend(parsed)
        self.num_calls += len(calls)
        return content, calls

    def _content(self, text: str) -> str:
        """``text`` as content to send now; once a block has opened, trailing whitespace is
        held back until more content follows.
        NOTE: the text around blocks is often just the newlines between them, which the whole
        output's content (stripped) does not have."""
        if not self._in_calls:
            return text
        text = self._held + text
        sent = text.rstrip()
        self._held = text[len(sent) :]
        return sent


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
