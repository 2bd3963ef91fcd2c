"""Structured outputs over HTTP: response_format and guided_* through llguidance on the shipped drafted pair; every
constrained reply keeps its grammar and equals its `"draft": false` reply, greedy and seeded."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "seed": 4}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    languages: list[str] = Field(max_length=3)


PERSON = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["name", "age"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}}}}}
CONSTRAINTS = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": PERSON},
    "guided_regex": {"guided_regex": r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"},
    "guided_choice": {"guided_choice": ["import os", "import sys", "from os import path"]},
    "guided_grammar": {"guided_grammar": 'start: call+\ncall: "print(" NUMBER ")\\n"\nNUMBER: /[0-9]{1,3}/'},
    "guided_grammar (GBNF)": {"guided_grammar": 'root ::= "def " [a-z]{1,8} "(" [a-z]{0,3} "):"'},
}


@pytest.fixture(scope="module")
def client(shipped):
    return openai.OpenAI(base_url=shipped.url + "/v1", api_key="unused", max_retries=0)


def chat(client, constraint: dict, draft=True, max_tokens=48, **sampling):
    fields = dict(constraint)
    response_format = fields.pop("response_format", openai.NOT_GIVEN)
    return client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=max_tokens,
                                          response_format=response_format, **sampling,
                                          extra_body={"draft": draft, "return_token_ids": True, **fields})


def keeps(name: str, text: str) -> bool:
    if name.startswith("json"):
        value = json.loads(text)
        return isinstance(value, dict) and (name == "json_object" or (set(value) <= {"name", "age"}
                                                                     and len(value["name"]) <= 12))
    if name == "guided_regex":
        return re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)", text) is not None
    if name == "guided_choice":
        return text in CONSTRAINTS[name]["guided_choice"]
    if name == "guided_grammar":
        return re.fullmatch(r"(print\([0-9]{1,3}\)\n)+", text) is not None
    return re.fullmatch(r"def [a-z]{1,8}\([a-z]{0,3}\):", text) is not None


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_constrained_replies_keep_their_grammar_and_equal_their_serial_replies_side_by_side(client, sampling):
    serial = {name: chat(client, c, draft=False, **sampling) for name, c in CONSTRAINTS.items()}
    with ThreadPoolExecutor(len(CONSTRAINTS)) as pool:
        drafted = dict(zip(CONSTRAINTS, pool.map(lambda c: chat(client, c, **sampling), CONSTRAINTS.values())))
    for name, reply in drafted.items():
        choice = reply.choices[0]
        assert choice.token_ids == serial[name].choices[0].token_ids, name
        if name != "guided_grammar":  # print(...) lines may run on to max_tokens; the others end by grammar
            assert choice.finish_reason == "stop", name
            assert keeps(name, choice.message.content), (name, choice.message.content)
    assert sum(r.usage.model_extra["tensorfold"]["accepted"] for r in drafted.values()) > 0


def test_the_client_s_parse_helper_gets_a_pydantic_model_back(client):
    for sampling in (GREEDY, SEEDED):
        parsed = client.chat.completions.parse(model="tiny-llama", messages=CHAT, response_format=Person,
                                               max_tokens=96, **sampling)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person) and len(person.name) <= 12 and len(person.languages) <= 3


def test_a_streamed_constrained_reply_joins_to_the_whole_one(client):
    whole = chat(client, CONSTRAINTS["json_schema"], **SEEDED).choices[0].message.content
    chunks = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=48, stream=True,
                                            response_format=PERSON, **SEEDED)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    json.loads(whole)


def test_completions_take_the_guided_fields_too(client):
    reply = client.completions.create(model="tiny-llama", prompt="x = ", max_tokens=8, temperature=0,
                                      extra_body={"guided_regex": "[0-9]+"})
    assert reply.choices[0].text.isdigit()


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_a_grammar_the_engine_refuses_is_a_400_naming_its_field(shipped, body, param):
    response = httpx.post(shipped.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
