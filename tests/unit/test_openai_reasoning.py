"""The reasoning parser of the OpenAI frontend (vLLM's --reasoning-parser qwen3), without a server: the parser over
text deltas cut anywhere, the chat stream and whole reply it produces, the option and the refusals."""
from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from openai_frontend.__main__ import _reasoning_parsers
from openai_frontend.app import Accumulated, _stream_body, _whole_choice, apply_reasoning
from openai_frontend.errors import APIError
from openai_frontend.protocol import parse_chat
from openai_frontend.reasoning import ReasoningStream, prompt_ends_reasoning, split
from openai_frontend.responses import ResponseBuilder
from openai_frontend.triton_io import Delta

# text -> (reasoning, content), as vLLM's current qwen3 parser splits a reply whose prompt left thinking on.
CASES = {
    "<think>\nLet me see.\n</think>\n\nParis.": ("\nLet me see.\n", "\n\nParis."),
    "Let me see.</think>Paris.": ("Let me see.", "Paris."),  # <think> was in the prompt (Qwen3.5's templates)
    "<think>cut before the end": ("cut before the end", None),  # max_tokens hit while thinking
    "no tags at all": ("no tags at all", None),  # all reasoning: the block never closed
    "<think>a<b</thin </think>": ("a<b</thin ", None),  # near-tags are text; nothing after the block
    "<think></think>x": ("", "x"),
    "<think>r</think>x<think>y</think>z": ("r", "x<think>y</think>z"),  # one block: later tags are content
    "ends on a partial </thi": ("ends on a partial </thi", None),
    "": ("", None),
}


def stream(text: str, cuts: tuple[int, ...], ended: bool = False) -> list[tuple[str, str]]:
    reader = ReasoningStream(ended)
    bounds = [0, *cuts, len(text)]
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        pieces += reader.feed(text[a:b])
    return pieces + reader.finish()


def joined(pieces: list[tuple[str, str]], kind: str) -> str:
    return "".join(t for k, t in pieces if k == kind)


@pytest.mark.parametrize("text", list(CASES))
def test_split_reads_each_case_as_vllms_qwen3_parser(text):
    assert split(text) == CASES[text]


@pytest.mark.parametrize("text", list(CASES))
def test_streamed_pieces_cut_at_any_two_positions_join_into_the_whole_split(text):
    reasoning, content = split(text)
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        pieces = stream(text, cuts)
        assert joined(pieces, "reasoning") == (reasoning or "") and joined(pieces, "content") == (content or ""), \
            (text, cuts, pieces)
        assert all(t for _, t in pieces), "no empty piece is sent"
        # reasoning never follows content
        kinds = [k for k, _ in pieces]
        assert kinds == sorted(kinds, key=lambda k: k != "reasoning"), (cuts, kinds)


def test_character_by_character_holds_a_tag_back_until_it_is_whole():
    text = "<think>ab</think>cd"
    reader = ReasoningStream()
    out = [reader.feed(ch) for ch in text]
    assert out[:7] == [[]] * 7  # "<think>" held, then dropped
    assert out[7] == [("reasoning", "a")] and out[8] == [("reasoning", "b")]
    assert out[9:17] == [[]] * 8 and out[17] == [("content", "c")]  # "</think>" held, then the content
    assert reader.finish() == []


def test_reasoning_over_before_the_model_starts_leaves_all_text_as_content():
    for text in CASES:
        assert split(text, ended=True) == (None, text)
        assert joined(stream(text, (len(text) // 2,), ended=True), "content") == text


@pytest.mark.parametrize("suffix,kwargs,ended", [
    ("<|im_start|>assistant\n", {}, False),  # the original Qwen3 template: the model writes <think> itself
    ("<|im_start|>assistant\n<think>\n", {}, False),  # Qwen3.5: the template opens the block
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, True),  # enable_thinking false, as rendered
    ("<|im_start|>assistant\n", {"enable_thinking": False}, True),  # a template that renders no empty block
    ("<|im_start|>assistant\n", {"enable_thinking": True}, False),
])
def test_prompt_ends_reasoning_reads_the_generation_prompt_and_enable_thinking(suffix, kwargs, ended):
    assert prompt_ends_reasoning(suffix, kwargs) is ended


# ---- the chat stream and the whole reply -------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(parser: str | None = "qwen3", ended: bool = False, **body):
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **body})
    apply_reasoning(req, parser, "<think>\n\n</think>\n\n" if ended else "")
    return req


def events(req, texts: list[str], reason: str = "eos") -> list[dict]:
    deltas = [[Delta(t, reason if i == len(texts) - 1 else None, 4, 1)] for i, t in enumerate(texts)]

    async def model():
        for d in deltas[1:]:
            yield d

    async def collect():
        return [e async for e in _stream_body(ResponseBuilder(req), req, deltas[0], model())]

    out = asyncio.run(collect())
    assert out[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in out[:-1]]


def whole(req, texts: list[str], reason: str = "eos") -> dict:
    c = Accumulated()
    for i, t in enumerate(texts):
        c.add(Delta(t, reason if i == len(texts) - 1 else None, 4, 1))
    content, finish, calls, reasoning = _whole_choice(req, c)
    body = ResponseBuilder(req).full([(content, finish, calls)], {}, None,
                                     [reasoning] if req.reasoning_parser else None)
    return body["choices"][0]


def fields(evs: list[dict]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in evs:
        for c in e["choices"]:
            for k, v in c["delta"].items():
                if isinstance(v, str):
                    out[k] = out.get(k, "") + v
    return out


TEXT = "<think>\nhm, <b>?\n</think>\n\nParis."


def test_stream_sends_reasoning_under_both_names_and_content_without_tags():
    texts = ["<thi", "nk>\nhm, <b", ">?\n</", "think>\n\nPar", "is."]
    evs = events(chat(stream=True), texts)
    got = fields(evs)
    assert got["reasoning_content"] == got["reasoning"] == "\nhm, <b>?\n"
    assert got["content"] == "\n\nParis."  # after the role chunk's ""
    for e in evs:  # one kind per delta, both names together
        d = e["choices"][0]["delta"]
        assert ("reasoning" in d) == ("reasoning_content" in d) and not ("reasoning" in d and d.get("content"))
    assert evs[-1]["choices"][0]["finish_reason"] == "stop"
    message = whole(chat(), texts)["message"]
    assert message["reasoning_content"] == message["reasoning"] == got["reasoning"]
    assert message["content"] == got["content"]


def test_cut_while_thinking_is_all_reasoning_and_null_content():
    message = whole(chat(), ["<think>still thinking"], "length")["message"]
    assert message == {"role": "assistant", "content": None, "reasoning_content": "still thinking",
                       "reasoning": "still thinking"}
    got = fields(events(chat(stream=True), ["<think>still ", "thinking"], "length"))
    assert got == {"role": "assistant", "content": "", "reasoning_content": "still thinking",
                   "reasoning": "still thinking"}


def test_enable_thinking_false_leaves_the_text_as_content_and_reasoning_null():
    req = chat(chat_template_kwargs={"enable_thinking": False})
    assert req.reasoning_ended
    assert whole(req, [TEXT])["message"] == {"role": "assistant", "content": TEXT, "reasoning_content": None,
                                             "reasoning": None}
    assert fields(events(chat(ended=True, stream=True), [TEXT[:9], TEXT[9:]])) == {"role": "assistant",
                                                                                   "content": TEXT}


def test_parser_off_changes_nothing():
    req = chat(None)
    assert whole(req, [TEXT])["message"] == {"role": "assistant", "content": TEXT}
    assert fields(events(chat(None, stream=True), [TEXT[:9], TEXT[9:]])) == {"role": "assistant", "content": TEXT}


def test_include_reasoning_false_drops_the_reasoning():
    req = chat(include_reasoning=False)
    assert whole(req, [TEXT])["message"] == {"role": "assistant", "content": "\n\nParis.", "reasoning_content": None,
                                             "reasoning": None}
    assert fields(events(chat(include_reasoning=False, stream=True), [TEXT])) == {"role": "assistant",
                                                                                   "content": "\n\nParis."}


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "<think>I need the weather. <tool_call> is how I ask.</think>\n\n" + call
    choice = whole(chat(tools=[WEATHER]), [text])
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "I need the weather. <tool_call> is how I ask."
    assert choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    evs = events(chat(tools=[WEATHER], stream=True), [text[i:i + 7] for i in range(0, len(text), 7)])
    got = fields(evs)
    assert got["reasoning"] == choice["message"]["reasoning"] and got["content"] == ""
    calls = [tc for e in evs for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert evs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # cut while thinking: no call is read out of the reasoning
    cut = whole(chat(tools=[WEATHER]), ["<think>" + call], "length")
    assert cut["message"]["content"] is None and "tool_calls" not in cut["message"]


def test_streamed_logprobs_ride_along_while_a_tag_is_held_back():
    from openai_frontend.triton_io import TokenLogprob

    req = chat(stream=True, logprobs=True)
    lp = [TokenLogprob(1, "<thi", -0.5, [("<thi", -0.5, 1)])]
    deltas = [[Delta("<thi", None, 4, 1, logprobs=lp)], [Delta("nk>a</think>b", "eos", 4, 1, logprobs=lp)]]

    async def model():
        yield deltas[1]

    async def collect():
        return [e async for e in _stream_body(ResponseBuilder(req), req, deltas[0], model())]

    evs = [json.loads(e[6:]) for e in asyncio.run(collect())[:-1]]
    tokens = [t["token"] for e in evs for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert tokens == ["<thi", "<thi"]  # every token's logprobs once, the held one included
    assert fields(evs) == {"role": "assistant", "content": "b", "reasoning_content": "a", "reasoning": "a"}


# ---- refusals and the option -----------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"thinking_token_budget": 100}, "thinking_token_budget"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include_reasoning": "no"}, "include_reasoning"),
])
def test_reasoning_requests_this_server_cannot_honour_are_refused_by_name(body, param):
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **body})
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_include_reasoning_false_without_a_parser_is_refused():
    with pytest.raises(APIError) as e:
        chat(None, include_reasoning=False)
    assert e.value.param == "include_reasoning" and "--reasoning-parser" in e.value.message
    chat(None, include_reasoning=True)  # the default asks for nothing


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
])
def test_a_constraint_while_thinking_is_refused_and_allowed_once_thinking_is_off(body, param):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.param == param and "enable_thinking" in e.value.message
    assert "structured_outputs" in chat(chat_template_kwargs={"enable_thinking": False}, **body).sampling
    assert "structured_outputs" in chat(None, **body).sampling


def test_reasoning_parser_option_per_model_and_for_all():
    assert _reasoning_parsers(["qwen3"]) == {"*": "qwen3"}
    assert _reasoning_parsers(["smol=qwen3", "qwen3"]) == {"smol": "qwen3", "*": "qwen3"}
    assert _reasoning_parsers([]) == {}
    for bad in ("deepseek_r1", "m=", "=qwen3", "m=nope"):
        with pytest.raises(ValueError, match="--reasoning-parser"):
            _reasoning_parsers([bad])
