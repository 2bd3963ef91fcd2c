"""A reply's text from arriving tokens: stop strings across token boundaries, hold-back, eos."""

from __future__ import annotations

import pytest

from tensorfold_core.server.reply import Reply
from tensorfold_core.testing import write_tokenizer
from tensorfold_core.tokenizer import Tokenizer

TEXT = "Hello world! The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


def feed_one_by_one(reply: Reply, ids) -> list[str]:
    texts = [reply.feed([t]).text for t in ids]
    return texts + [reply.finish().text]


def test_pieces_join_to_the_decode_of_the_token_ids(tokenizer):
    ids = tokenizer.encode(TEXT)
    reply = Reply(tokenizer)
    assert "".join(feed_one_by_one(reply, ids)) == TEXT == tokenizer.decode(reply.token_ids)
    assert reply.token_ids == ids


def test_a_stop_string_spanning_tokens_cuts_the_text_right_before_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    boundary = next(len(p) for p in pieces if len(p) > TEXT.index("quick"))  # a token ends inside "quick..."
    stop = TEXT[boundary - 2:boundary + 2]
    assert TEXT.find(stop) == boundary - 2
    reply = Reply(tokenizer, [stop])
    assert "".join(feed_one_by_one(reply, ids)) == TEXT[:boundary - 2]
    assert reply.stopped and tokenizer.decode(reply.token_ids).startswith(TEXT[:boundary + 2])


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    reply = Reply(tokenizer, ["fox!"])
    out = feed_one_by_one(reply, tokenizer.encode("The quick brown fox"))
    joined_before_finish = "".join(out[:-1])
    assert "fox" not in joined_before_finish and joined_before_finish.startswith("The quick brown")
    assert out[-1].endswith("fox") and "".join(out) == "The quick brown fox"
    assert not reply.stopped


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    reply = Reply(tokenizer, ["lazy", "quick", "jumps"])
    reply.feed(tokenizer.encode(TEXT))
    assert reply.stopped and reply.finish().text == "" and reply.text == "Hello world! The "


def test_an_eos_token_ends_the_reply_and_is_in_neither_text_nor_token_ids(tokenizer):
    eos = next(iter(tokenizer.eos_ids))
    ids = tokenizer.encode("Hello world")
    reply = Reply(tokenizer, eos_ids=tokenizer.eos_ids)
    piece = reply.feed(ids + [eos] + ids)
    assert piece.token_ids == ids and reply.saw_eos
    assert piece.text + reply.finish().text == "Hello world" and reply.token_ids == ids
    assert reply.feed(ids).token_ids == []
