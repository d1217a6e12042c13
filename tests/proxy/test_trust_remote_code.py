"""vLLM's --trust-remote-code: a tokenizer whose class is Python code in its folder loads
only with it, in the engine, in a proxy over a remote engine (which sends that code) and
in a proxy over vLLM; without it, one line and nothing run."""

from __future__ import annotations

import json
import shutil

import pytest

from tokendance.backend.api import BackendError, InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.remote import RemoteBackend
from tokendance.examples import cli
from tokendance.proxy import serve

from .test_remote import served

CODE = '''
from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    made_here = True  # the class this file defines, not transformers' own
'''


@pytest.fixture(scope="module")
def custom(tiny_llama, tmp_path_factory):
    """The tiny Llama with a tokenizer class of its own (auto_map to custom_tok.py)."""
    folder = tmp_path_factory.mktemp("custom") / "llama"
    shutil.copytree(tiny_llama, folder)
    (folder / "custom_tok.py").write_text(CODE)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]}, tokenizer_class="CustomTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_the_engine_loads_it_only_when_trusted(custom):
    with pytest.raises(InvalidRequest, match="custom code") as e:
        Engine(model=str(custom), dtype="float32", kv_tokens=2048)
    assert "\n" not in e.value.message.strip()
    eng = Engine(model=str(custom), dtype="float32", kv_tokens=2048, trust_remote_code=True)
    assert type(eng.tokenizer).__name__ == "CustomTokenizer" and eng.tokenizer.made_here
    (toks, _, _), = eng.generate([eng.tokenizer.encode("hello")], SamplingParams(max_tokens=3, temperature=0))
    assert len(toks) == 3


async def test_a_proxy_runs_the_engines_tokenizer_code_only_when_trusted(custom):
    async with served(custom, offload_bytes=0, trust_remote_code=True) as engine:
        with pytest.raises(BackendError, match=r"code of its own \(custom_tok.py\): give --trust-remote-code"):
            await RemoteBackend.connect(engine.url)
        be = await RemoteBackend.connect(engine.url, trust_remote_code=True)
        try:
            assert type(be.tokenizer).__name__ == "CustomTokenizer"
            assert be.tokenizer.encode("hello there") == engine.backend.tokenizer.encode("hello there")
        finally:
            await be.close()


def test_the_flag_reaches_each_backend(monkeypatch, capsys, custom):
    seen = []

    def remote(urls, mode, key, trust=False):
        seen.append(trust)
        raise ValueError("no engine here")

    monkeypatch.setattr(serve, "remote", remote)
    assert cli.main(["serve", "--engine", "http://127.0.0.1:1", "--trust-remote-code"]) == 1
    assert seen == [True]  # not refused as an engine flag: the proxy runs the engine's tokenizer
    assert "set the engine" not in capsys.readouterr().err
    assert cli.main(["serve", "--engine", "http://127.0.0.1:1", "--dtype", "float32"]) == 1
    assert "--dtype set the engine" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--model", str(custom), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "custom code" in err and "\n" not in err
    assert cli.main(["generate", "hi", "--model", str(custom), "--max-tokens", "2", "--trust-remote-code"]) == 0


async def test_a_proxy_over_vllm_loads_its_tokenizer_folder_only_when_trusted(custom, vllm):
    from tokendance.backend.vllm import VLLMBackend

    with pytest.raises(BackendError, match="custom code"):
        await VLLMBackend.connect(vllm.url, str(custom))
    be = await VLLMBackend.connect(vllm.url, str(custom), trust_remote_code=True)
    try:
        assert type(be.tokenizer).__name__ == "CustomTokenizer"
    finally:
        await be.close()
