"""vLLM's --tokenizer: the model served with another folder's tokenizer and chat template
(for a GGUF, its original model's); one line where that folder is none, holds no
tokenizer, or holds ids past the model's vocabulary."""

from __future__ import annotations

import pytest

from tokendance.backend.api import InvalidRequest
from tokendance.backend.engine import Engine
from tokendance.backend.prompt import render_chat
from tokendance.examples import cli

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
CHAT = [{"role": "user", "content": "hi"}]


def engine(model, **kw) -> Engine:
    return Engine(model=str(model), dtype="float32", kv_tokens=1024, **kw)


@pytest.fixture
def other(tiny_llama, tmp_path):
    """The tiny model's tokenizer files with a chat template of their own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_the_given_tokenizer_renders_the_chats(tiny_llama, other):
    own, given = engine(tiny_llama), engine(tiny_llama, tokenizer=str(other))
    assert render_chat(given.tokenizer, CHAT) == "<<user>> hi\n<<assistant>>"
    assert "<|im_start|>user\nhi<|im_end|>" in render_chat(own.tokenizer, CHAT)  # SmolLM2's own
    assert given.eos == own.eos


def test_a_tokenizer_that_is_not_the_models_is_one_line(tiny_llama, make_model, tmp_path):
    small = make_model("llama", vocab_size=2048)  # SmolLM2's tokenizer files beside it: its own is not checked
    with pytest.raises(InvalidRequest, match="holds 49152 tokens, the model 2048: not this model's"):
        engine(small, tokenizer=str(tiny_llama))
    with pytest.raises(InvalidRequest, match=f"--tokenizer {tmp_path / 'none'}: no such file or folder"):
        engine(tiny_llama, tokenizer=str(tmp_path / "none"))
    with pytest.raises(InvalidRequest, match=f"the tokenizer at {tmp_path} does not load") as e:
        engine(tiny_llama, tokenizer=str(tmp_path))  # no tokenizer files in it
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--tokenizer", "--hf-config-path"])
def test_serve_engine_and_generate_take_it_and_say_what_is_wrong(tiny_llama, tmp_path, capsys, flag):
    """--tokenizer, and --hf-config-path beside it (tests/backend/test_gguf.py)."""
    for command, *prompt in (("serve",), ("engine",), ("generate", "hi")):
        assert cli.main([command, "--model", str(tiny_llama), flag, str(tmp_path / "none"), *prompt]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f"tokendance {command}: {flag} {tmp_path / 'none'}: no such file or folder, nor a Hugging "
                       "Face model id (such as Qwen/Qwen2.5-0.5B-Instruct)")
