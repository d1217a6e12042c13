"""Request fields about the prompt's and the answer's tokens, through the real engine on a
tiny random model: completions' echo, vLLM's prompt_logprobs, token ids, banned tokens,
truncation and chat echo."""

import openai
import pytest


@pytest.fixture(scope="module")
def model(engine_model) -> str:
    return engine_model


@pytest.fixture(scope="module")
def client(engine_client) -> openai.OpenAI:
    return engine_client


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_echo_gives_the_prompt_and_its_logprobs_before_the_answer(client, model):
    """The legacy completions' echo: the text begins with the prompt; with logprobs the
    prompt's tokens come first, the first one's logprob null; streamed, the first chunk
    carries them; max_tokens 0 scores the prompt alone."""
    prompt = "The river runs to the sea"
    kw = dict(model=model, prompt=prompt, temperature=0, max_tokens=3, logprobs=2)
    plain = client.completions.create(**{**kw, "logprobs": None})
    whole = client.completions.create(**kw, echo=True)
    c = whole.choices[0]
    assert c.text == prompt + plain.choices[0].text
    lp = c.logprobs
    n = whole.usage.prompt_tokens
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens[:n]) == prompt and lp.text_offset[n] == len(prompt)
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(x.choices[0].text for x in chunks) == c.text
    assert sum((x.choices[0].logprobs.tokens for x in chunks), []) == lp.tokens
    scored = client.completions.create(**{**kw, "max_tokens": 0}, echo=True)
    s = scored.choices[0]
    assert s.text == prompt and s.logprobs.token_logprobs == lp.token_logprobs[:n]
    assert (s.finish_reason, scored.usage.completion_tokens) == ("length", 0)


def test_prompt_logprobs_as_vllm_gives_them(client, model):
    """vLLM's prompt_logprobs: per prompt token (null for the first) a map from token id to
    logprob, rank and text: the token's own, then its k best alternatives (ranks 1..k);
    on each completion choice, once for a chat; a streamed 0 is dropped."""
    prompt = "The river runs to the sea"
    kw = dict(model=model, prompt=prompt, temperature=0, max_tokens=2)
    echoed = client.completions.create(**kw, echo=True, logprobs=3).choices[0].logprobs
    r = client.completions.create(**kw, n=2, extra_body={"prompt_logprobs": 2})
    n = r.usage.prompt_tokens
    got = [c.model_extra["prompt_logprobs"] for c in r.choices]
    assert got[0] == got[1] and len(got[0]) == n and got[0][0] is None
    for i, d in enumerate(got[0][1:], 1):
        own = next(iter(d.values()))  # the prompt token's entry comes first
        assert own["decoded_token"] == echoed.tokens[i]
        assert own["logprob"] == pytest.approx(echoed.token_logprobs[i], abs=1e-5)
        tops = sorted((v for v in d.values() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in tops] == [1, 2] and len(d) == 2 + (own["rank"] > 2)
        assert [v["decoded_token"] for v in tops] == list(echoed.top_logprobs[i])[:2]
        likelier = sum(x > own["logprob"] for x in echoed.top_logprobs[i].values())  # of the echo's 3 best
        assert own["rank"] == 1 + likelier if likelier < 3 else own["rank"] > 3
    assert client.completions.create(**kw).choices[0].model_extra["prompt_logprobs"] is None
    chat = client.chat.completions.create(model=model, messages=user("Hi."), max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == chat.usage.prompt_tokens and all(len(d) == 1 for d in scored[1:])
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 0}))
    assert all("prompt_logprobs" not in c.choices[0].model_extra for c in chunks if c.choices)


def test_allowed_token_ids_and_bad_words_reach_the_engine(client, model, engine_live):
    """vLLM's fields (backend/banned.py has the engine's tests)."""
    tok = engine_live.backend.engine.tokenizer
    kw = dict(model=model, prompt="The river", temperature=0, max_tokens=4)
    r = client.completions.create(**kw, extra_body={"allowed_token_ids": [1040]})
    assert r.choices[0].text == tok.decode([1040] * 4)
    plain = client.completions.create(**kw, logprobs=0).choices[0].logprobs.tokens
    word = plain[1].strip() or plain[1]
    r = client.completions.create(**kw, logprobs=0, extra_body={"bad_words": [word]})
    assert word not in [t.strip() or t for t in r.choices[0].logprobs.tokens]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"allowed_token_ids": [10**9]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_return_token_ids_as_vllm_gives_them(client, model, engine_live):
    """vLLM's return_token_ids: the prompt's ids (a chat's once, a completion's per choice)
    and each choice's output ids; streamed, the prompt's in the first chunk and each
    chunk's own output ids."""
    tok = engine_live.backend.engine.tokenizer
    ask = {"return_token_ids": True}
    kw = dict(model=model, prompt=[5, 6, 7, 8], temperature=0, max_tokens=5, n=2)
    r = client.completions.create(**kw, extra_body=ask)
    for c in r.choices:
        assert c.model_extra["prompt_token_ids"] == [5, 6, 7, 8]
        assert len(c.model_extra["token_ids"]) == 5 and tok.decode(c.model_extra["token_ids"]) == c.text
    chunks = [c for c in client.completions.create(**kw, stream=True, extra_body=ask) if c.choices]
    for i in range(2):
        mine = [c.choices[0].model_extra for c in chunks if c.choices[0].index == i]
        assert mine[0]["prompt_token_ids"] == [5, 6, 7, 8] and all("prompt_token_ids" not in m for m in mine[1:])
        assert sum((m["token_ids"] for m in mine), []) == r.choices[i].model_extra["token_ids"]
    assert "token_ids" not in client.completions.create(**kw).choices[0].model_extra
    chat = dict(model=model, messages=user("Tell me more."), temperature=0, max_tokens=6)
    whole = client.chat.completions.create(**chat, extra_body=ask)
    assert len(whole.model_extra["prompt_token_ids"]) == whole.usage.prompt_tokens
    out = whole.choices[0].model_extra["token_ids"]
    assert len(out) == 6 and tok.decode(out, skip_special_tokens=True) == whole.choices[0].message.content
    streamed = list(client.chat.completions.create(**chat, stream=True, extra_body=ask))
    assert streamed[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert sum((c.choices[0].model_extra.get("token_ids", []) for c in streamed[1:] if c.choices), []) == out


def test_a_chats_echo_begins_with_the_assistants_last_message(client, model):
    """vLLM's chat echo, with continue_final_message: the answer is the whole message."""
    said = "The river runs"
    kw = dict(model=model, temperature=0, max_tokens=4,
              messages=[{"role": "user", "content": "Go on."}, {"role": "assistant", "content": said}])
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=go_on).choices[0].message.content
    whole = client.chat.completions.create(**kw, extra_body={**go_on, "echo": True}).choices[0].message.content
    assert whole == said + plain
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**go_on, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    user_last = client.chat.completions.create(**{**kw, "messages": user("Go on.")}, extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith("Go on.")  # only the assistant's is echoed


def test_return_tokens_as_token_ids_names_logprobs_by_id(client, model):
    ask = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    chat = client.chat.completions.create(model=model, messages=user("Hi."), max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=ask)
    lps = chat.choices[0].logprobs.content
    assert [t.token for t in lps] == [f"token_id:{i}" for i in chat.choices[0].model_extra["token_ids"]]
    assert all(t.bytes == list(t.token.encode()) and x.token.startswith("token_id:")
               for t in lps for x in t.top_logprobs)
    text = client.completions.create(model=model, prompt="Hi.", max_tokens=3, temperature=0, logprobs=2,
                                     extra_body=ask).choices[0]
    assert text.logprobs.tokens == [f"token_id:{i}" for i in text.model_extra["token_ids"]]
    assert all(k.startswith("token_id:") for top in text.logprobs.top_logprobs for k in top)


def test_logprob_token_ids_list_those_tokens_at_every_step(client, model):
    """vLLM's logprob_token_ids: each token's alternatives are exactly the asked ones, in
    their order and each once, over top_logprobs; whole, streamed and in completions; the
    sampled token's own logprob is where it was."""
    ids = [17, 5, 17, 250]
    kw = dict(model=model, messages=user("Hi."), max_tokens=3, temperature=0, logprobs=True, top_logprobs=4)
    whole = client.chat.completions.create(**kw, extra_body={"logprob_token_ids": ids})
    plain = client.chat.completions.create(**kw)
    lps, top = whole.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [t.token for t in lps] == [t.token for t in top] and len(lps) == 3
    assert [t.logprob for t in lps] == pytest.approx([t.logprob for t in top], abs=1e-5)
    named = client.chat.completions.create(**kw, extra_body={"logprob_token_ids": ids,
                                                             "return_tokens_as_token_ids": True})
    for t in named.choices[0].logprobs.content:
        assert [x.token for x in t.top_logprobs] == ["token_id:17", "token_id:5", "token_id:250"]
        assert all(x.logprob < 0 for x in t.top_logprobs)
    chunks = client.chat.completions.create(**kw, stream=True, extra_body={"logprob_token_ids": ids})
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [[(x.token, x.logprob) for x in t.top_logprobs] for t in streamed] == \
        [[(x.token, x.logprob) for x in t.top_logprobs] for t in lps]
    text = client.completions.create(model=model, prompt="Hi.", max_tokens=2, temperature=0, logprobs=1,
                                     extra_body={"logprob_token_ids": [17, 5]}).choices[0]
    assert all(len(top) == 2 for top in text.logprobs.top_logprobs)


@pytest.mark.parametrize("kw, message", [
    (dict(logprob_token_ids=[5]), "logprob_token_ids needs logprobs set"),
    (dict(logprob_token_ids=[5, 10**9], logprobs=True), "outside the vocabulary"),
    (dict(logprob_token_ids=list(range(129)), logprobs=True), "between 1 and 128"),
])
def test_logprob_token_ids_that_cannot_be_are_a_400(client, model, kw, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=user("Hi."), max_tokens=2,
                                       extra_body={"logprob_token_ids": kw.pop("logprob_token_ids")}, **kw)
    assert e.value.body["param"] == "logprob_token_ids" and message in e.value.body["message"]


def test_repetition_detection_ends_a_loop(client, model):
    """vLLM's repetition_detection: only token 5 may be sampled, so the answer loops from
    its first token; it ends at the fourth, whole and streamed, past min_tokens."""
    loop = {"allowed_token_ids": [5], "return_token_ids": True,
            "repetition_detection": {"max_pattern_size": 3, "min_count": 4}}
    kw = dict(model=model, messages=user("Hi."), max_tokens=20, temperature=0)
    c = client.chat.completions.create(**kw, extra_body=loop).choices[0]
    assert (c.finish_reason, c.model_extra["stop_reason"], c.model_extra["token_ids"]) == \
        ("repetition", "repetition_detected", [5] * 4)
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**loop, "min_tokens": 6}))
    ends = [(x.choices[0].finish_reason, x.choices[0].model_extra.get("stop_reason")) for x in chunks
            if x.choices and x.choices[0].finish_reason]
    assert ends == [("repetition", "repetition_detected")]
    assert sum(len(x.choices[0].model_extra.get("token_ids") or []) for x in chunks if x.choices) == 6
    text = client.completions.create(model=model, prompt="Hi.", max_tokens=20, temperature=0, extra_body=loop)
    assert text.choices[0].finish_reason == "repetition" and text.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"repetition_detection": {"max_pattern_size": 2,
                                                                                  "min_count": 1}})
    assert e.value.body["param"] == "repetition_detection" and "min_count" in e.value.body["message"]


def test_return_prompt_text_gives_the_chat_as_templated(client, model, tok):
    """vLLM's return_prompt_text: the prompt's text, which tokenizes to its token ids; in
    a stream, on the first chunk only."""
    kw = dict(model=model, messages=user("Name a river."), max_tokens=2, temperature=0)
    ask = {"return_prompt_text": True, "return_token_ids": True}
    r = client.chat.completions.create(**kw, extra_body=ask)
    text = r.model_extra["prompt_text"]
    assert "Name a river." in text and tok.encode(text, add_special_tokens=False) == r.model_extra["prompt_token_ids"]
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=ask))
    assert chunks[0].model_extra["prompt_text"] == text
    assert all("prompt_text" not in c.model_extra for c in chunks[1:])
    assert "prompt_text" not in client.chat.completions.create(**kw).model_extra


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model, engine_live):
    kw = dict(model=model, temperature=0, max_tokens=4)
    cut = client.completions.create(**kw, prompt=list(range(5, 25)),
                                    extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True})
    tail = client.completions.create(**kw, prompt=list(range(19, 25)))
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].model_extra["prompt_token_ids"] == list(range(19, 25))
    assert cut.choices[0].text == tail.choices[0].text
    n = engine_live.backend.info.max_model_len
    whole = client.completions.create(**kw, prompt=[5, 6, 7], extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 3
    for k in (0, -2, n + 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, messages=user("Hi."), extra_body={"truncate_prompt_tokens": k})
        assert e.value.body["param"] == "truncate_prompt_tokens"


def test_truncation_side_right_keeps_the_prompts_start(client, model):
    kw = dict(model=model, temperature=0, max_tokens=4)
    cut = client.completions.create(**kw, prompt=list(range(5, 25)), extra_body={
        "truncate_prompt_tokens": 6, "truncation_side": "right", "return_token_ids": True})
    head = client.completions.create(**kw, prompt=list(range(5, 11)))
    assert cut.choices[0].model_extra["prompt_token_ids"] == list(range(5, 11))
    assert cut.choices[0].text == head.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, messages=user("Hi."), extra_body={"truncation_side": "middle"})
    assert e.value.body["param"] == "truncation_side"


def test_stop_reason_names_the_stop_string_or_token(client, model):
    kw = dict(model=model, temperature=0, max_tokens=8, prompt="Once upon a time")
    free = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    assert free.finish_reason == "length" and free.model_extra["stop_reason"] is None
    first = free.model_extra["token_ids"][1]
    by_token = client.completions.create(**kw, extra_body={"stop_token_ids": [first]}).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_extra["stop_reason"] == first
    word = free.text[len(free.text) // 2:][:3]
    assert len(word) == 3
    by_text = client.completions.create(**kw, stop=[word, "\x00"]).choices[0]
    assert by_text.finish_reason == "stop" and by_text.model_extra["stop_reason"] == word
    chat = dict(model=model, temperature=0, max_tokens=8, stop=[word], messages=user("Once upon a time"))
    whole = client.chat.completions.create(**chat).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(**chat, stream=True) if c.choices]
    assert [c.model_extra["stop_reason"] for c in streamed if c.finish_reason] == [whole.model_extra["stop_reason"]]
    assert all("stop_reason" not in c.model_extra for c in streamed if not c.finish_reason)
