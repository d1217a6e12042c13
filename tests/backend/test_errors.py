"""Bad input gets one clear error each."""

from __future__ import annotations

import json
import shutil

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tests.conftest import TOKENIZER_FILES


def test_missing_model_path(tmp_path):
    with pytest.raises(InvalidRequest, match="no such file or folder, nor a Hugging Face model id"):
        Engine(model=str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(InvalidRequest, match="unsupported architecture.*GPT2LMHeadModel"):
        Engine(model=str(tmp_path))


@pytest.mark.parametrize("text,match", [("{not json", "config.json is not valid JSON"),
                                        ("[1, 2]", "config.json is not a JSON object"),
                                        ('{"architectures": ["LlamaForCausalLM"], "vocab_size": 8}',
                                         "config.json lacks hidden_size, intermediate_size"),
                                        ('{"architectures": ["LlamaForCausalLM"], "vocab_size": "x", '
                                         '"hidden_size": 64, "intermediate_size": 0, "num_hidden_layers": 2, '
                                         '"num_attention_heads": 4, "head_dim": 16.5}',
                                         "vocab_size, intermediate_size, head_dim must be positive integers")])
def test_broken_config_json(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(InvalidRequest, match=match) as e:
        Engine(model=str(tmp_path))
    assert e.value.param == "model"


def test_unsupported_rope_scaling(make_model):
    # dynamic NTK (frequencies that change with the length so far): not taken
    folder = make_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(InvalidRequest, match="unsupported rope_scaling type 'dynamic'"):
        Engine(model=str(folder))


def test_folder_without_weights(tmp_path, tiny_llama):
    for name in ("config.json", *TOKENIZER_FILES):  # all but the weights
        if (tiny_llama / name).exists():
            shutil.copy(tiny_llama / name, tmp_path / name)
    with pytest.raises(InvalidRequest, match="no .safetensors"):
        Engine(model=str(tmp_path))


def test_folder_without_a_tokenizer(tmp_path, tiny_llama):
    """Its tokenizer is read before the weights: one line naming the folder."""
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(InvalidRequest, match=f"the tokenizer at {tmp_path} does not load") as e:
        Engine(model=str(tmp_path))
    assert e.value.param == "model" and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024, max_model_len=256)


def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequest, match="256 tokens") as e:
        engine.add("a", [5] * 300, SamplingParams())
    assert e.value.code == "context_length_exceeded"


def test_max_tokens_past_the_context_stops_at_its_end(engine):
    """As the proxy documents: not an error, the generation ends where the context does."""
    (toks, _, reason), = engine.generate([[5] * 250], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(toks) == 256 - 250 and reason == "length"


def test_empty_prompt_and_bad_ids(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add("a", [], SamplingParams())
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add("a", [10**6], SamplingParams())


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -0.5, "temperature"), ("temperature", 3.0, "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"), ("top_logprobs", 21, "top_logprobs"),
    ("seed", 2**63, "seed"), ("seed", -2**63 - 1, "seed"), ("stop", ["end", ""], "stop"),
])
def test_invalid_sampling(engine, field, value, param):
    with pytest.raises(InvalidRequest) as e:
        engine.add("a", [5, 6], SamplingParams(**{field: value}))
    assert e.value.param == param
    assert not engine.has_work()


def test_bad_dtype(tiny_llama):
    with pytest.raises(InvalidRequest, match="unsupported dtype"):
        Engine(model=str(tiny_llama), dtype="int8")


def test_bad_bases(tiny_llama):
    with pytest.raises(InvalidRequest, match="unknown bases 'agent'; choose one of standalone, producer"):
        Engine(model=str(tiny_llama), bases="agent")


@pytest.mark.parametrize("device,message", [("nonsense", "unsupported device"), ("mps", "unsupported device"),
                                            ("cuda:99", "is not available here")])
def test_bad_device(tiny_llama, device, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        Engine(model=str(tiny_llama), device=device)
    assert e.value.param == "device"
