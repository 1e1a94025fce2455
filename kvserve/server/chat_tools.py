"""Chat requests with tools or an output constraint: the request's plan, the prompt messages,
and the response message / stream deltas built from the generated text.

- ``tool_choice`` none: tools are not shown to the model; plain content.
- auto (the default with tools): tools in the prompt; ``<tool_call>`` blocks in the output
  become ``tool_calls`` (``--tool-call-parser``).
- required / a named function: the output is generated under a JSON schema (structured
  output), so the arguments always parse: for a named function its parameter schema, for
  required an array of ``{"name", "arguments"}`` objects.
A response with calls has ``finish_reason: "tool_calls"`` (unless max_tokens cut it short).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.server import protocol as p
from kvserve.server.errors import APIError
from kvserve.server.tools import (
    ParsedCall,
    StreamingToolParser,
    function_parameters,
    hermes_messages,
    native_messages,
    new_call_id,
    parse_tool_calls,
    required_calls,
    required_calls_schema,
    scan_required_calls,
    template_supports_tools,
    tools_as_dicts,
)
from kvserve.structured.spec import StructuredOutputsParams


@dataclass
class ChatPlan:
    """How one chat request uses tools and constraints."""

    tool_mode: str = "none"  # none | auto | required | named
    tools: list[dict[str, Any]] = field(default_factory=list)
    function_name: str | None = None  # named mode
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None
    constraint_param: str | None = None  # the request field the constraint came from


def plan_chat(req: p.ChatCompletionRequest) -> ChatPlan:
    """Validate tools / tool_choice / response_format / structured_outputs together."""
    plan = ChatPlan(parallel=req.parallel_tool_calls)
    tools = tools_as_dicts(req.tools) if req.tools else []
    choice = req.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise APIError("tool_choice needs tools", param="tool_choice")
    if tools:
        if choice is None or choice == "auto":
            plan.tool_mode = "auto"
        elif choice == "none":
            plan.tool_mode = "none"
        elif choice == "required":
            plan.tool_mode = "required"
        else:
            assert isinstance(choice, p.NamedToolChoice)
            names = [t["function"]["name"] for t in tools]
            if choice.function.name not in names:
                raise APIError(
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    f"in tools ({', '.join(names)})",
                    param="tool_choice",
                )
            plan.tool_mode = "named"
            plan.function_name = choice.function.name
        plan.tools = tools if plan.tool_mode != "none" else []
    constraints: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format is not None and req.response_format.type != "text":
        fmt = req.response_format
        constraints.append(_constraint("response_format", lambda: response_format_params(fmt)))
    if req.structured_outputs is not None:
        extra = req.structured_outputs
        constraints.append(_constraint("structured_outputs", lambda: structured_params(extra)))
    if plan.tool_mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == plan.function_name)
        schema = function_parameters(tool)
        constraints.append(_constraint("tools", lambda: StructuredOutputsParams(json=schema)))
    elif plan.tool_mode == "required":
        schema = required_calls_schema(tools, plan.parallel)
        constraints.append(_constraint("tools", lambda: StructuredOutputsParams(json=schema)))
    if len(constraints) > 1:
        names = " and ".join(name for name, _ in constraints)
        # NOTE: the param named is the second constraint's: the first is the one kept.
        raise APIError(
            f"only one output constraint per request: got {names}", param=constraints[1][0]
        )
    if constraints:
        plan.constraint_param, plan.constraint = constraints[0]
    return plan


def _constraint(
    param: str, build: Callable[[], StructuredOutputsParams]
) -> tuple[str, StructuredOutputsParams]:
    """(``param``, the constraint ``build`` makes of it); its ValueError is a 400 naming
    ``param``."""
    try:
        return param, build()
    except ValueError as e:
        raise APIError(str(e), param=param) from e


def response_format_params(fmt: p.ResponseFormat) -> StructuredOutputsParams:
    """The engine's StructuredOutputsParams of OpenAI's ``response_format`` (not "text")."""
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    # NOTE: the schema is always enforced exactly (strict or not): the grammar engine rejects
    # keywords it cannot enforce instead of ignoring them.
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def structured_params(req: p.StructuredOutputsRequest) -> StructuredOutputsParams:
    """The engine's StructuredOutputsParams of the ``structured_outputs`` extra."""
    return StructuredOutputsParams(
        json=req.json_schema,
        json_object=bool(req.json_object),
        regex=req.regex,
        choice=req.choice,
        grammar=req.grammar,
    )


def prompt_messages(
    chat: list[p.ChatMessage], plan: ChatPlan, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) for the prompt of the messages ``chat``."""
    messages = [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
            **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
            **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
        }
        for m in chat
    ]
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if not plan.tools and not has_tool_turns:
        return [{"role": m["role"], "content": m["content"]} for m in messages], {}
    if template_supports_tools(template):
        extra = {"tools": plan.tools} if plan.tools else {}
        return native_messages(messages), extra
    return hermes_messages(messages, plan.tools), {}


# ---- responses ------------------------------------------------------------------------------


def _tool_calls(calls: list[ParsedCall]) -> list[p.ToolCall]:
    return [
        p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def response_message(
    plan: ChatPlan, text: str, finish_reason: str | None
) -> tuple[p.ChatResponseMessage, str | None]:
    """The assistant message for one finished sample, and its finish_reason."""
    calls: list[ParsedCall] | None = None
    content: str | None = text
    if plan.tool_mode == "auto":
        content, calls = parse_tool_calls(text)
        if not plan.parallel:
            calls = calls[:1]
    elif plan.tool_mode == "named":
        calls, content = [ParsedCall(plan.function_name or "", text)], None
    elif plan.tool_mode == "required":
        calls = required_calls(text)
        content = None if calls else text
    if not calls:
        return p.ChatResponseMessage(content=text), finish_reason
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return p.ChatResponseMessage(content=content, tool_calls=_tool_calls(calls)), reason


class ToolStream:
    """Turns one sample's text deltas into chat deltas with ``tool_calls`` as OpenAI streams
    them: a call's first delta carries its index, id, type and name; arguments follow."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.parser = StreamingToolParser() if plan.tool_mode == "auto" else None
        self.buffer = ""
        self.num_calls = 0
        self.named_id: str | None = None
        self.args_sent: list[int] = []  # required: each call's arguments characters sent

    def delta(
        self, text: str, finish_reason: str | None
    ) -> tuple[p.DeltaMessage | None, str | None]:
        """(delta or None when there is nothing to send yet, finish_reason)."""
        mode = self.plan.tool_mode
        calls: list[p.DeltaToolCall] = []
        content = ""
        if mode == "auto":
            assert self.parser is not None
            content, parsed = self.parser.feed(text)
            if finish_reason is not None:
                more_content, more = self.parser.finish()
                content += more_content
                parsed = parsed + more
            if not self.plan.parallel:
                parsed = parsed[: max(0, 1 - self.num_calls)]
            calls = [self._whole_call(c) for c in parsed]
        elif mode == "named":
            if self.named_id is None:
                self.named_id = new_call_id()
                header = self._header(self.named_id, self.plan.function_name or "")
                assert header.function is not None
                header.function.arguments = text
                calls.append(header)
                self.num_calls = 1
            elif text:
                calls.append(p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(arguments=text)))
        elif mode == "required":
            self.buffer += text
            calls = self._required_deltas()
            if finish_reason is not None and not self.num_calls:
                content = self.buffer  # not even a name written: nothing is lost
        if finish_reason == "stop" and self.num_calls:
            finish_reason = "tool_calls"
        if not content and not calls:
            return None, finish_reason
        return p.DeltaMessage(content=content or None, tool_calls=calls or None), finish_reason

    def _header(self, call_id: str, name: str) -> p.DeltaToolCall:
        return p.DeltaToolCall(
            index=self.num_calls,
            id=call_id,
            type="function",
            function=p.DeltaFunctionCall(name=name, arguments=""),
        )

    def _required_deltas(self) -> list[p.DeltaToolCall]:
        """What the buffer holds that was not sent: a call's header once its name is written
        (the ``required`` output is constrained JSON, scanned as it grows), then its
        arguments' JSON text as it comes."""
        deltas = []
        for index, span in enumerate(scan_required_calls(self.buffer)):
            if index == self.num_calls:
                if span.name is None:
                    break
                deltas.append(self._header(new_call_id(), span.name))
                self.num_calls += 1
                self.args_sent.append(0)
            args = span.arguments(self.buffer)
            new = args[self.args_sent[index] :]
            if not new:
                continue
            self.args_sent[index] = len(args)
            if deltas and deltas[-1].index == index:
                assert deltas[-1].function is not None
                deltas[-1].function.arguments = new
            else:
                deltas.append(
                    p.DeltaToolCall(index=index, function=p.DeltaFunctionCall(arguments=new))
                )
        return deltas

    def _whole_call(self, call: ParsedCall) -> p.DeltaToolCall:
        delta = self._header(call.id, call.name)
        assert delta.function is not None
        delta.function.arguments = call.arguments
        self.num_calls += 1
        return delta


def drop_none(value: Any) -> Any:
    """``value`` without None-valued dict keys, recursively (OpenAI omits unset fields)."""
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value
