"""Models by their Hugging Face hub id, from the local hub cache (vLLM's `serve ORG/NAME`,
--revision, --tokenizer-revision, --download-dir; backend/hub.py), and vLLM's --load-format.
The caches here are laid out as huggingface_hub lays its own: models--ORG--NAME/refs/BRANCH
holding a commit, snapshots/COMMIT/ the files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.examples import cli
from tests.conftest import TOKENIZER_FILES

MAIN = "1" * 40
V1 = "2" * 40
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def cached(cache: Path, repo: str, commit: str, folder: Path, *refs: str, files: tuple[str, ...] = ()) -> Path:
    """`folder` (or only its `files`) as the snapshot `commit` of `repo` in `cache`, the
    refs (branches, tags) pointing at it."""
    home = cache / ("models--" + repo.replace("/", "--"))
    snap = home / "snapshots" / commit
    if files:
        snap.mkdir(parents=True)
        for name in files:
            if (folder / name).exists():
                shutil.copy(folder / name, snap / name)
    else:
        shutil.copytree(folder, snap)
    for ref in refs:
        (home / "refs").mkdir(parents=True, exist_ok=True)
        (home / "refs" / ref).write_text(commit)
    return snap


def engine(**kw):
    from tokendance.backend.engine import Engine

    return Engine(dtype="float32", kv_tokens=1024, **kw)


@pytest.fixture(scope="module")
def hub(tiny_llama, make_model, tmp_path_factory) -> Path:
    """org/tiny: main the tiny Llama, v1 (a tag) one of three layers; org/tok: the tokenizer
    alone on main, no tokenizer files at "bare"."""
    cache = tmp_path_factory.mktemp("hub")
    cached(cache, "org/tiny", MAIN, tiny_llama, "main")
    cached(cache, "org/tiny", V1, make_model("llama", num_hidden_layers=3), "v1")
    cached(cache, "org/tok", MAIN, tiny_llama, "main", files=TOKENIZER_FILES)
    cached(cache, "org/tok", V1, tiny_llama, "bare", files=("config.json",))
    return cache


def test_a_hub_id_is_served_from_the_cache_as_its_folder_is(hub, tiny_llama):
    eng = engine(model="org/tiny", download_dir=str(hub))
    assert eng.folder == hub / "models--org--tiny" / "snapshots" / MAIN
    assert eng.name == "org/tiny" and eng.mcfg.num_layers == 2  # vLLM's served name: the id
    want = engine(model=str(tiny_llama)).generate([[5, 6, 7, 8]], GREEDY)[0][0]
    assert eng.generate([[5, 6, 7, 8]], GREEDY)[0][0] == want


@pytest.mark.parametrize("revision", ["v1", V1])
def test_a_revision_is_a_tag_branch_or_commit(hub, revision):
    assert engine(model="org/tiny", revision=revision, download_dir=str(hub)).mcfg.num_layers == 3


def test_what_the_cache_lacks_is_one_line_saying_where_it_looked(hub, tmp_path):
    with pytest.raises(InvalidRequest, match=rf"model org/tiny is in the Hugging Face cache at {hub}, but not "
                                             r"at revision v2 \(it holds main, v1\)") as e:
        engine(model="org/tiny", revision="v2", download_dir=str(hub))
    assert e.value.param == "model"
    with pytest.raises(InvalidRequest, match=rf"model org/other: no such file or folder, nor a model in the "
                                             rf"Hugging Face cache at {hub} \(nothing is downloaded: `hf "
                                             r"download org/other` puts it there\)"):
        engine(model="org/other", download_dir=str(hub))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InvalidRequest, match="a file that is not a .gguf"):
        engine(model=str(tmp_path / "notes.txt"))


def test_the_tokenizer_and_config_by_hub_id_at_their_revisions(hub, tiny_llama):
    eng = engine(model=str(tiny_llama), tokenizer="org/tok", hf_config_path="org/tiny", download_dir=str(hub))
    assert len(eng.tokenizer) == 49152 and eng.mcfg.num_layers == 2
    with pytest.raises(InvalidRequest, match="the tokenizer at .*snapshots/2{40} does not load") as e:
        engine(model=str(tiny_llama), tokenizer="org/tok", tokenizer_revision="bare", download_dir=str(hub))
    assert e.value.param == "tokenizer"
    # the tokenizer's revision is the model's unless given: org/tok has no v1
    with pytest.raises(InvalidRequest, match="--tokenizer org/tok is in the Hugging Face cache .* not at revision v1"):
        engine(model="org/tiny", revision="v1", tokenizer="org/tok", download_dir=str(hub))
    assert engine(model="org/tiny", revision="v1", tokenizer="org/tok", tokenizer_revision="main",
                  download_dir=str(hub)).mcfg.num_layers == 3


@pytest.mark.parametrize("command", ["serve", "engine", "generate"])
def test_the_commands_take_hub_ids_and_say_what_is_missing(hub, capsys, command):
    prompt = ["hi", "--max-tokens", "2"] if command == "generate" else []
    model = ["--model", "org/none"] if command == "generate" else ["org/none"]
    assert cli.main([command, *model, "--download-dir", str(hub), *prompt]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"tokendance {command}: model org/none: no such file or folder, nor a model in the Hugging "
                   f"Face cache at {hub} (nothing is downloaded: `hf download org/none` puts it there)")
    if command == "generate":
        assert cli.main(["generate", "hi", "--model", "org/tiny", "--revision", "v1", "--download-dir", str(hub),
                         "--max-tokens", "2", "--raw"]) == 0


def test_the_cache_is_huggingface_hubs_own_by_default(hub, tmp_path):
    """HF_HUB_CACHE names it, as for every Hugging Face library (read once, at import)."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "0"}
    code = "import sys; from tokendance.examples.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--model", "org/tiny", "--raw",
                          "--max-tokens", "2", "--dtype", "float32"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    env["HF_HUB_CACHE"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--model", "org/tiny"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and f"nor a model in the Hugging Face cache at {tmp_path} " in run.stderr


def test_load_format_dummy_serves_random_weights_from_a_config_and_a_tokenizer(tiny_llama, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        if (tiny_llama / name).exists():
            shutil.copy(tiny_llama / name, bare / name)
    with pytest.raises(InvalidRequest, match="no .safetensors weights"):
        engine(model=str(bare))
    assert cli.main(["generate", "hi", "--model", str(bare), "--load-format", "dummy", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("args,err", [
    (["--load-format", "gguf"], "--load-format gguf: the model {model} is not a .gguf file"),
    (["--model", "x.gguf", "--load-format", "safetensors"],
     "--load-format safetensors: the model x.gguf is a .gguf file"),
])
def test_a_load_format_that_is_not_the_models_is_one_line(tiny_llama, capsys, args, err):
    model = [] if "--model" in args else ["--model", str(tiny_llama)]
    for command in ("serve", "engine"):
        assert cli.main([command, *model, *args]) == 1
        assert capsys.readouterr().err.strip() == f"tokendance {command}: " + err.format(model=tiny_llama)


def test_a_load_format_we_do_not_read_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--load-format", "pt"])
    assert "argument --load-format: invalid choice: 'pt'" in capsys.readouterr().err


async def test_a_proxy_over_vllm_finds_a_hub_models_tokenizer_in_the_cache(hub):
    from tokendance.backend.api import BackendError
    from tokendance.backend.vllm import VLLMBackend

    from tests.proxy import fake_vllm

    fake = await fake_vllm.served(fake_vllm.FakeVLLM("org/tiny"))  # vLLM serves what it was given: the id
    try:
        be = await VLLMBackend.connect(fake.url, download_dir=str(hub))
        try:
            assert len(be.tokenizer) == 49152
        finally:
            await be.close()
        with pytest.raises(BackendError, match=f"the model {fake.url} serves org/tiny is in the Hugging Face "
                                               "cache .* not at revision v9"):
            await VLLMBackend.connect(fake.url, download_dir=str(hub), revision="v9")
    finally:
        await fake.runner.cleanup()


def test_serve_over_vllm_takes_the_flags_that_find_its_tokenizer(hub, capsys):
    """Not refused as our engine's flags: the proxy looks the vLLM server's model up by them."""
    flags = ["--revision", "v1", "--tokenizer-revision", "main", "--download-dir", str(hub)]
    assert cli.main(["serve", "--vllm", "http://127.0.0.1:1", *flags]) == 1
    err = capsys.readouterr().err
    assert "no vLLM server at http://127.0.0.1:1" in err and "set our engine" not in err
    assert cli.main(["serve", "--vllm", "http://127.0.0.1:1", "--load-format", "dummy"]) == 1
    assert "--load-format set our engine: a vLLM server has its own" in capsys.readouterr().err
