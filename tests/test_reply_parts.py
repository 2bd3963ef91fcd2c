"""A chat reply's text read into reasoning, content and tool calls: streamed pieces join to the whole reading, however
the text is cut; the prompt side checks tool_call_ids and writes Hermes text for templates without a tool format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from tensorfold_core.errors import RequestError
from tensorfold_core.plugins import registry
from tensorfold_core.server.chat import ChoiceText
from tensorfold_core.server.reasoning import ReasoningSplitter, marks_reasoning, reply_opening
from tensorfold_core.server.schemas import NamedToolChoice, ToolSpec
from tensorfold_core.server.structured import Grammars
from tensorfold_core.server.tools import CallReader, Toolbox, renders_tools, template_messages
from tensorfold_core.tokenizer import Tokenizer

NAMES = frozenset({"get_weather", "add"})
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TEXTS = [
    "plain text, no calls at all \n",
    f"Let me add. \n{CALL}\n",
    f"{CALL}\n{OTHER}",
    f"before {CALL} between {OTHER} after  ",
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> kept as text',
    "<tool_call>\nnot json\n</tool_call>",
    f"{CALL}\n<tool_call>\n{{\"name\": \"add\"",  # the second block is left open: text
    "a < b and <tool_ is no tag",
    "<think>\nweighing it up\n</think>\n\nthe answer",
    f"<think>should I call?</think>\n{CALL}",
    "  <think>open and never closed",
    "no think here <think>late tag</think> stays content",
    "</think> closes a block the prompt opened\n\nanswer",
]


def read(texts: list[str], inside: bool, most: int | None = None):
    """Feed pieces through a fresh choice's text; joined reasoning, content, and the calls' (name, arguments)."""
    choice = ChoiceText(ReasoningSplitter(inside), CallReader(NAMES, most))
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(texts):
        parts = choice.feed(piece, final=i == len(texts) - 1)
        reasoning, content = reasoning + parts.reasoning, content + parts.content
        calls += [(c.name, json.loads(c.arguments)) for c in parts.calls]
    return reasoning, content, calls


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 80), max_size=8), st.booleans(), st.sampled_from([None, 1]))
def test_streamed_pieces_join_to_the_whole_reading_wherever_the_text_is_cut(text, cuts, inside, most):
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert read(pieces, inside, most) == read([text], inside, most)


def test_calls_are_read_from_their_blocks_and_blanks_touching_them_are_dropped():
    assert read([f"Let me add. \n{CALL}\n"], False) == ("", "Let me add.", [("add", {"a": 1, "b": 2})])
    assert read([f"{CALL}\n{OTHER}"], False)[2] == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert read([f"{CALL}\n{OTHER}"], False, most=1) == ("", OTHER, [("add", {"a": 1, "b": 2})])


def test_a_block_that_is_not_a_call_of_a_given_tool_stays_content():
    for text in TEXTS[4:6]:
        assert read([text], False) == ("", text, [])
    assert read(["plain text \n"], False) == ("", "plain text \n", [])  # no calls: nothing is stripped


def test_reasoning_is_what_the_reply_or_its_prompt_opens_and_the_rest_is_content():
    assert read(["<think>\nweighing it up\n</think>\n\nthe answer"], False) == ("\nweighing it up\n", "the answer", [])
    assert read(["</think> closes a block the prompt opened\n\nanswer"], True)[:2] == \
        ("", "closes a block the prompt opened\n\nanswer")
    assert read(["  <think>open and never closed"], False)[:2] == ("open and never closed", "")
    assert read(["no think here <think>late tag</think> stays content"], False)[0] == ""
    assert read([f"<think>should I call?</think>\n{CALL}"], False) == \
        ("should I call?", "", [("add", {"a": 1, "b": 2})])


def test_a_template_marks_reasoning_by_its_closing_tag_and_its_prompt_says_where_the_reply_begins():
    assert marks_reasoning("{{ '<think>\\n' }}...</think>") and not marks_reasoning("{{ messages }}")
    assert reply_opening("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert reply_opening("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert reply_opening("<|im_start|>assistant\n") == "start"


def test_a_template_reading_tools_has_its_own_tool_format():
    assert renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


def tools(*names: str) -> list[ToolSpec]:
    return [ToolSpec.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "additionalProperties": False, "properties": {"a": {"type": "integer"}}}}})
        for name in names]


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo, and 1 + 2?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": "3"},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
]


def test_without_a_tool_format_calls_and_results_go_in_as_hermes_text_results_named_by_their_call():
    toolbox = Toolbox.from_request(tools("get_weather", "add"), None, None)
    out = template_messages(HISTORY, toolbox, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert out[3]["content"] == ('<tool_response>\n{"name": "add", "content": 3}\n</tool_response>\n'
                                 '<tool_response>\n{"name": "get_weather", "content": "sunny"}\n</tool_response>')


def test_a_template_with_a_tool_format_gets_the_messages_with_arguments_as_objects():
    out = template_messages(HISTORY, None, native=True)
    assert out[2]["tool_calls"][1]["function"]["arguments"] == {"a": 1, "b": 2}
    assert out[3] == HISTORY[3]


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "tool_call_id": "call_z", "content": "x"}, "messages[5].tool_call_id"),
    ({"role": "tool", "content": "x"}, "messages[5].tool_call_id"),
    ({"role": "user", "tool_call_id": "call_a", "content": "x"}, "messages[5].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": "{1"}}]},
     "messages[5].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": "[1]"}}]},
     "messages[5].tool_calls[0].function.arguments"),
])
def test_a_tool_message_must_answer_an_earlier_call_and_calls_must_hold_json_objects(message, param):
    with pytest.raises(RequestError) as caught:
        template_messages(HISTORY + [message], None, native=True)
    assert caught.value.param == param


def test_on_a_thinking_turn_a_forced_call_may_follow_free_reasoning_and_nothing_else_is_loosened():
    grammars = Grammars(Tokenizer.from_dir(registry().shipped("tiny-llama").path))
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
    tool_grammar = Toolbox.from_request(tools("add"), named, None).grammar()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 7}}\n</tool_call>'

    def accepts(reasoning: bool | None, text: str) -> bool:
        vocab = grammars.tokenizer.backend.get_vocab_size()
        constraint = grammars.for_request({}, tool_grammar, reasoning).matcher(vocab)
        for token in grammars.tokenizer.encode(text, add_special_tokens=False):
            constraint.consume(token)
        return not constraint.matcher.is_error() and constraint.matcher.is_accepting()

    assert accepts(True, f"free <b>thought</b>, even {call}</think>\n\n{call}")  # the prompt opened the block
    assert accepts(False, call) and accepts(False, f"<think>hm</think>\n{call}")  # the reply may open one
    assert accepts(None, call) and not accepts(None, f"<think>hm</think>\n{call}")  # not a thinking turn
    assert not accepts(True, call) and not accepts(False, f"hm</think>\n{call}")
