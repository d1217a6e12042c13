"""A segmented prompt is tokenized whole; shared segments hold the tokens inside them
(backend/prompt.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaTokenizer

from tokendance.backend.api import Request, SamplingParams, Segment
from tokendance.backend.engine import Engine
from tokendance.backend.keys import segment_key
from tokendance.backend.prompt import render_chat, request_ids, tokenize
from tokendance.backend.service import EngineBackend

CORPUS = ["I think the sky is blue because of Rayleigh scattering. Bob said: Blue, clearly. "
          "What do you say?\nAda agrees with Bob."] * 20


@pytest.fixture(scope="module")
def bpe(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


def sentencepiece(bos: bool = False) -> LlamaTokenizer:
    """transformers' Llama 2 / Mistral tokenizer ("▁" for spaces, one before the text)
    over a vocabulary trained here; `bos` puts "<s>" before a text when special tokens
    are asked for."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(t.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=bos)


def spans_text(tok, ids, spans) -> list[str]:
    return [tok.decode(ids[a:b]) for a, b in spans]


def test_the_prompt_is_tokenized_whole_and_a_token_across_an_edge_is_private(bpe):
    segs = [Segment("<|im_start|>user\nAda: "), Segment("I think the sky is blue.", shared=True),
            Segment("\n\nBob said:\n"), Segment("Blue, clearly.", shared=True),
            Segment("<|im_end|>\n<|im_start|>assistant\n")]
    ids, spans = tokenize(bpe, segs)
    assert ids == bpe("".join(s.text for s in segs), add_special_tokens=False).input_ids
    # " I" takes in the space before the segment: the reader's own token.
    assert spans_text(bpe, ids, spans) == [" think the sky is blue.", "Blue, clearly."]
    alone = [t for s in segs for t in bpe.encode(s.text, add_special_tokens=False)]
    assert alone != ids  # tokenized apart, the prompt would read " ", "I"


def test_sentencepiece_segments_add_no_spaces():
    tok = sentencepiece()
    segs = [Segment("Ada: "), Segment("I think the sky is blue.", shared=True), Segment(" Bob said:\n"),
            Segment("Blue, clearly.", shared=True)]
    text = "".join(s.text for s in segs)
    ids, spans = tokenize(tok, segs)
    assert tok.decode(ids) == text
    alone = [t for s in segs for t in tok.encode(s.text, add_special_tokens=False)]
    assert tok.decode(alone) != text  # a "▁" before every segment: spaces the text never had
    assert spans_text(tok, ids, spans) == ["think the sky is blue.", "Blue, clearly."]


@pytest.mark.parametrize("special", [False, True])
def test_a_bos_is_added_only_when_asked_and_is_never_shared(special):
    tok = sentencepiece(bos=True)
    segs = [Segment("I think the sky is blue.", shared=True), Segment(" Bob said: no.")]
    ids, spans = tokenize(tok, segs, special)
    assert (ids[0] == tok.bos_token_id) == special
    assert spans == [(int(special), int(special) + len(tok.encode(segs[0].text, add_special_tokens=False)))]


def test_segments_shorter_than_a_token_or_side_by_side(bpe):
    ids, spans = tokenize(bpe, [Segment("Rayl"), Segment("eigh", shared=True), Segment(" scattering")])
    assert spans == [] and ids == bpe("Rayleigh scattering", add_special_tokens=False).input_ids
    segs = [Segment("One answer.", shared=True), Segment(" Another answer.", shared=True)]
    ids, spans = tokenize(bpe, segs)
    assert spans_text(bpe, ids, spans) == ["One answer.", " Another answer."]
    assert tokenize(bpe, []) == ([], [])


def test_a_reader_quoting_an_answer_after_a_name_finds_the_producers_kv(smollm2):
    # "Ada: " before the answer: the reader's first token of it takes in the space (" The"
    # where the producer generated "The"), and the rest of the answer is the producer's
    # run without its first token, published for exactly this. After a line break the
    # reader holds the whole run.
    engine = Engine(model=str(smollm2), dtype="float32", kv_tokens=2048, bases="producer")
    prompt = engine.encode(render_chat(engine.tokenizer, [{"role": "user", "content": "Name two colours."}]))
    engine.add("p", prompt, SamplingParams(max_tokens=12, temperature=0), publish=True)
    seq = engine.seqs["p"]
    while engine.has_work():
        engine.step()
    answer = seq.detok.text.strip()
    whole = len(engine.encode(answer))
    for before, held in (("Ada: ", whole - 1), ("Ada said:\n", whole)):
        ids, spans = tokenize(engine.tokenizer, [Segment(before), Segment(answer, shared=True), Segment("\nYou?")])
        (a, b), = spans
        assert b - a == held
        entry = engine.segments.get(segment_key("", ids[a:b]))
        assert entry is not None and entry.source == "producer" and entry.ntokens == b - a
    assert spans_text(engine.tokenizer, *tokenize(engine.tokenizer, [Segment("Ada:\n"), Segment(answer, shared=True)])) == [answer]


def test_a_tokenizer_without_offsets_is_refused_when_the_server_starts(tiny_llama):
    engine = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=256)
    engine.tokenizer = SimpleNamespace(is_fast=False)  # a slow (Python) tokenizer: no offsets
    with pytest.raises(ValueError, match="no fast"):
        EngineBackend(engine)


def test_truncation_keeps_the_prompts_last_tokens_and_whole_segments_only():
    r = Request("r", [], SamplingParams(), prompt_token_ids=list(range(10, 30)),
                shared_spans=[(2, 6), (8, 12), (14, 18)], truncate=12)
    ids, spans = request_ids(None, r)
    assert ids == list(range(18, 30)) and spans == [(0, 4), (6, 10)]
    r.truncate = 11
    assert request_ids(None, r) == (list(range(19, 30)), [(5, 9)])  # (8, 12) was cut into: private
    r.truncate = 20
    assert request_ids(None, r) == (list(range(10, 30)), [(2, 6), (8, 12), (14, 18)])


def test_truncation_from_the_right_keeps_the_prompts_first_tokens():
    r = Request("r", [], SamplingParams(), prompt_token_ids=list(range(10, 30)),
                shared_spans=[(2, 6), (8, 12), (14, 18)], truncate=12, truncation_side="right")
    assert request_ids(None, r) == (list(range(10, 22)), [(2, 6), (8, 12)])
    r.truncate = 11
    assert request_ids(None, r) == (list(range(10, 21)), [(2, 6)])  # (8, 12) still whole
    r.truncate = 10
    assert request_ids(None, r) == (list(range(10, 20)), [(2, 6)])  # (8, 12) cut into: private
