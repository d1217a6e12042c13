"""OpenAI's Conversations API with the real openai SDK: a conversation made, read, updated
and deleted, its items listed by page, added, read and deleted, and responses that go on
in it (their items added as they end, their session kept, the oldest turns left out
with truncation auto); every misuse a 4xx."""

from __future__ import annotations

import openai
import pytest

from tokendance.proxy.conversations import Conversation
from tokendance.proxy.stored import Store

from .conftest import FakeBackend, Threaded

MODEL = "fake-tiny"


def prompt(echo) -> str:
    return echo.backend.last_prompt()


def test_a_conversation_and_its_items(client):
    c = client.conversations.create(metadata={"topic": "bridges"},
                                    items=[{"role": "user", "content": "first words"}])
    assert (c.object, c.metadata, c.id[:5]) == ("conversation", {"topic": "bridges"}, "conv_")
    assert client.conversations.retrieve(c.id).created_at == c.created_at
    assert client.conversations.update(c.id, metadata={"topic": "rivers"}).metadata == {"topic": "rivers"}
    added = client.conversations.items.create(c.id, items=[
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "an answer"}]},
        {"role": "user", "content": "more words"}])
    assert [i.type for i in added.data] == ["message", "message"] and not added.has_more
    page = client.conversations.items.list(c.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["first words", "an answer"] and page.has_more
    assert [i.content[0].text for i in client.conversations.items.list(c.id, order="asc").data] == \
        ["first words", "an answer", "more words"]
    assert [i.content[0].text for i in client.conversations.items.list(c.id).data][0] == "more words"  # desc
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=c.id)
    assert one.content[0].text == "an answer"
    client.conversations.items.delete(added.data[0].id, conversation_id=c.id)
    assert len(client.conversations.items.list(c.id).data) == 2
    gone = client.conversations.delete(c.id)
    assert (gone.id, gone.deleted) == (c.id, True)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(c.id)


def test_responses_go_on_in_a_conversation(client, echo):
    c = client.conversations.create(items=[{"role": "user", "content": "we talk about bridges"}])
    r1 = client.responses.create(model=MODEL, input="one two", conversation=c.id, instructions="brief",
                                 extra_body={"tokendance": {"session": "conv-s", "agent": "ada"}})
    assert r1.conversation.id == c.id and r1.output_text == "one two"
    assert "we talk about bridges" in prompt(echo) and "one two" in prompt(echo)
    texts = [i.content[0].text for i in client.conversations.items.list(c.id, order="asc").data]
    assert texts == ["we talk about bridges", "one two", "one two"]  # the input, then the answer
    raw = client.responses.with_raw_response.create(model=MODEL, input="three", conversation={"id": c.id})
    assert raw.headers["X-TokenDance-Session"] == "conv-s" and raw.headers["X-TokenDance-Round"] == "2"
    assert prompt(echo).count("one two") == 2 and "brief" not in prompt(echo)  # instructions not kept
    assert len(client.conversations.items.list(c.id).data) == 5
    # store: false still adds to the conversation; a streamed response too
    client.responses.create(model=MODEL, input="four", conversation=c.id, store=False)
    list(client.responses.create(model=MODEL, input="five", conversation=c.id, stream=True))
    assert [i.content[0].text for i in client.conversations.items.list(c.id, limit=2).data] == ["five", "five"]


def test_what_a_conversation_refuses(client, echo):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", conversation="conv_nope")
    assert e.value.body["param"] == "conversation"
    c = client.conversations.create()
    assert client.conversations.items.list(c.id).data == []
    other = echo.client("sk-other")
    with pytest.raises(openai.NotFoundError):  # another key's conversation
        other.conversations.retrieve(c.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="x", conversation=c.id)
    for bad, param in (({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
                       ({"metadata": {"k" * 65: "v"}}, "metadata"),
                       ({"items": [{"type": "item_reference", "id": "x"}]}, "items[0].type")):
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.create(**bad)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("msg_nope", conversation_id=c.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.delete("msg_nope", conversation_id=c.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.delete("conv_nope")
    with pytest.raises(openai.BadRequestError):
        client.conversations.items.list(c.id, limit=0)


def test_the_store_weighs_a_conversation_again_as_it_grows():
    store = Store(10_000)
    c = Conversation("conv_x", "t", {})
    store.put(c.id, c)
    first = store.bytes
    c.items.append(b'{"id": "msg_1", "content": "words"}')
    store.put(c.id, c)
    assert store.bytes == c.size == c.weight() > first
    c.items.append(b"x" * 20_000)  # over the budget now: let go
    store.put(c.id, c)
    assert store.bytes == 0 and store.get(c.id, "t") is None


def test_truncation_auto_leaves_out_the_oldest_turns_until_the_prompt_fits():
    t = Threaded(FakeBackend(length=8, max_model_len=60))
    try:
        client = t.client()
        said = [f"turn{i} " + "word " * 9 for i in range(6)]
        c = client.conversations.create(items=[
            {"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(said)])
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="and now?", conversation=c.id)
        assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "input")
        r = client.responses.create(model=MODEL, input="and now?", conversation=c.id, truncation="auto")
        kept = t.backend.last_prompt()
        assert r.truncation == "auto" and "and now?" in kept and "turn5" in kept
        assert "turn0" not in kept and "turn1" not in kept  # a whole turn left out, its answer with it
        # the conversation itself keeps every item, the new ones last
        assert len(client.conversations.items.list(c.id, limit=100).data) == 8
        with pytest.raises(openai.BadRequestError):  # nothing to leave out: the input alone is too long
            client.responses.create(model=MODEL, input="word " * 70, truncation="auto")
    finally:
        t.close()
