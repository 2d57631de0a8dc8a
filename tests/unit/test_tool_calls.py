"""Tool calling in the OpenAI frontend, without a server: the constraint each tool_choice asks of the engine,
the prompt a tool-less chat template gets, and tool calls read back from whole and streamed text."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from inflight.sequence import SamplingParams
from openai_frontend.chat import hermes_messages
from openai_frontend.errors import APIError
from openai_frontend.protocol import parse_chat
from openai_frontend.tools import ToolStream, parse_output

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "weather?"}]


def chat(**body):
    return parse_chat({"model": "m", "messages": ASK, **body})


def test_named_function_is_enforced_by_its_parameter_schema():
    req = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert req.sampling["structured_outputs"] == {"json": TIME["function"]["parameters"]}
    SamplingParams(structured_outputs=req.sampling["structured_outputs"])  # the engine takes it
    content, calls = parse_output(req.tools, '{"zone": "UTC"}')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_required_is_a_list_of_calls_to_the_given_functions():
    req = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = req.sampling["structured_outputs"]["json"]
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "get_weather", "arguments": {"zone": "x"}}],
                [{"name": "rm_rf", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, calls = parse_output(req.tools, json.dumps(good))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"})]


def test_auto_and_none_constrain_nothing():
    assert "structured_outputs" not in chat(tools=[WEATHER]).sampling
    req = chat(tools=[WEATHER], tool_choice="none")
    assert not req.tools.active and parse_output(req.tools, "<tool_call>{}</tool_call>")[1] == []


def test_auto_reads_hermes_blocks_from_the_text():
    req = chat(tools=[WEATHER, TIME])
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_output(req.tools, text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET"}
    assert parse_output(req.tools, "Just text, <tool_call>not json</tool_call>") == \
        ("Just text, <tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_auto_streaming_holds_back_a_split_tag_and_emits_whole_calls(cut):
    req = chat(tools=[WEATHER])
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    stream = ToolStream(req.tools)
    deltas = []
    for i in range(0, len(text), cut):
        deltas += stream.feed(text[i:i + cut])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert content == "Sure" and len(calls) == 1 and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    plain = ToolStream(req.tools)
    assert "".join(d["content"] for d in plain.feed("a < b") + plain.feed(" <to") + plain.finish()) == "a < b <to"


def test_named_streaming_sends_the_call_head_once_then_argument_pieces():
    req = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    stream = ToolStream(req.tools)
    first, second = stream.feed('{"city"'), stream.feed(': "Rome"}')
    head = first[0]["tool_calls"][0]
    assert head["function"]["name"] == "get_weather" and head["id"].startswith("call_")
    assert second == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Rome"}'}}]}]


def test_a_tool_less_template_gets_the_tools_and_the_history_as_text():
    req = parse_chat({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    msgs = hermes_messages(req.messages, req.tools)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
    {"tools": [WEATHER, WEATHER]},
    {"tools": [{"type": "code_interpreter"}]},
    {"tools": [WEATHER], "tool_choice": "sometimes"},
    {"tools": [WEATHER], "parallel_tool_calls": "yes"},
])
def test_bad_tools_are_a_400_naming_the_field(body):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param in ("tools", "tool_choice", "parallel_tool_calls")


def test_response_format_maps_onto_structured_outputs_on_both_endpoints():
    from openai_frontend.protocol import parse_completion
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat(response_format=fmt).sampling["structured_outputs"] == {"json": schema}
    assert parse_completion({"model": "m", "prompt": "p", "response_format": {"type": "json_object"}}) \
        .sampling["structured_outputs"] == {"json_object": True}
    assert chat(guided_choice=["a", "b"]).sampling["structured_outputs"] == {"choice": ["a", "b"]}
    assert "structured_outputs" not in chat(response_format={"type": "text"}).sampling


CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
CALL_CET = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
# Model outputs that the whole-text reader and the streamed one must read alike, however the text is cut.
AUTO_OUTPUTS = {
    "unparseable_block": "Just text, <tool_call>not json</tool_call> and more",
    "two_calls": "Let me check.\n" + CALL_ROME + "\n" + CALL_CET,
    "bad_block_then_call": "A <tool_call>bad</tool_call> B " + CALL_CET + " C",
    "text_between_calls": CALL_ROME + "\nThen: " + CALL_CET + "\n\n",
    "cut_inside_a_block": 'Calling <tool_call>{"name": "get_weather", "arguments": {"ci',
    "ended_before_the_close_tag": 'Calling <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
    "call_then_cut_block": CALL_CET + ' and <tool_call>{"name": "get_time"',
    "open_tag_twice": "<tool_call><tool_call>" + CALL_CET[len("<tool_call>"):] + " tail",
    "tag_prefixes": "a < b <to",
    "stray_close_and_open": "stray </tool_call> close and <tool_call",
    "whitespace": "  \n",
    "empty": "",
}


def _read_streamed(tools, pieces: list[str]) -> tuple[str, list]:
    stream = ToolStream(tools)
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [(tc["index"], tc["function"]) for d in deltas for tc in d.get("tool_calls", [])]
    return content, calls


def _cuts(text: str, rng) -> list[list[str]]:
    """Every cut into two pieces, one character at a time, and random cuts into many pieces."""
    ways = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(30):
        bounds = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if text else []
        ways.append([text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])])
    return ways


@pytest.mark.parametrize("name", AUTO_OUTPUTS)
def test_auto_streamed_content_and_calls_equal_the_whole_reply_however_the_text_is_cut(name):
    text = AUTO_OUTPUTS[name]
    req = chat(tools=[WEATHER, TIME])
    content, calls = parse_output(req.tools, text)
    expected = (content or "", [(i, c["function"]) for i, c in enumerate(calls)])
    for pieces in _cuts(text, random.Random(46)):
        assert _read_streamed(req.tools, pieces) == expected, pieces


def test_auto_keeps_every_character_that_is_not_a_call():
    req = chat(tools=[WEATHER, TIME])
    text = "Just text, <tool_call>not json</tool_call> and more"
    assert parse_output(req.tools, text) == (text, [])
    assert _read_streamed(req.tools, [text[:15], text[15:]]) == (text, [])
    # An unparseable block before a call, and text after it, stay; the whitespace before each call goes.
    content, calls = parse_output(req.tools, "A <tool_call>bad</tool_call> B " + CALL_CET + " C")
    assert content == "A <tool_call>bad</tool_call> B C" and [c["function"]["name"] for c in calls] == ["get_time"]
    assert parse_output(req.tools, AUTO_OUTPUTS["text_between_calls"])[0] == "Then:"
    # A block the output ended inside is a call when its JSON is whole, else text.
    cut = 'Calling <tool_call>{"name": "get_weather", "arguments": {"ci'
    assert parse_output(req.tools, cut) == (cut, [])
    content, calls = parse_output(req.tools, 'Calling <tool_call>{"name": "get_weather", "arguments": {}}')
    assert content == "Calling" and calls[0]["function"] == {"name": "get_weather", "arguments": "{}"}
