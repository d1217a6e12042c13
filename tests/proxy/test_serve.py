"""`tokendance serve`: flags, one-line errors, and a real process drained by SIGTERM."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tokendance.backend.flags import engine_options
from tokendance.backend.parallel import free_port
from tokendance.examples import cli
from tokendance.proxy import serve

from .conftest import FakeBackend, Threaded

FAKE = Path(__file__).with_name("fake_backend.py")
SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fake_backend", sys.argv[1])
fake = importlib.util.module_from_spec(spec); spec.loader.exec_module(fake)
from tokendance.proxy import serve
serve.load_backend = lambda args: fake.FakeBackend(length=30, delay=0.02)
from tokendance.examples.cli import main
sys.exit(main(["serve", "--port", sys.argv[2], "--log-level", "warning"]))
"""


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", *argv])


def test_vllms_names_of_host_memory_and_the_http_log():
    a = parse("--swap-space", "2.5", "--uvicorn-log-level", "warning")
    assert (a.offload_gib, a.uvicorn_log_level) == (2.5, "warning")
    with pytest.raises(SystemExit):
        parse("--uvicorn-log-level", "loud")


def test_flags():
    a = parse()
    assert (a.host, a.port, a.model, a.mqtt, a.mode, a.barrier_timeout_ms, a.offload_gib) == \
        ("127.0.0.1", 8000, None, None, None, 250.0, None)
    a = parse("--port", "9001", "--mqtt", "mqtt://127.0.0.1:1883", "--barrier-timeout-ms", "40",
              "--mode", "prefix", "--dtype", "float32", "--model", "/m")
    c = serve.config(a)
    assert (a.port, a.mode, a.dtype, a.model, c.barrier_timeout) == (9001, "prefix", "float32", "/m", 0.04)
    assert a.func is serve.main
    assert serve.config(parse()).reasoning is None
    assert serve.config(parse("--reasoning-parser", "deepseek_r1")).reasoning == "deepseek_r1"
    with pytest.raises(SystemExit):  # argparse names the choices
        parse("--reasoning-parser", "o1")
    assert serve.config(parse()).tool_parser is None
    a = parse("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")  # vLLM's command line
    assert serve.config(a).tool_parser == "llama3_json"
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "pythonic")
    assert not serve.config(parse()).trust_chat_template  # vLLM's default: a request's own is a 400
    assert serve.config(parse("--trust-request-chat-template")).trust_chat_template
    assert serve.config(parse()).response_role == "assistant"
    assert serve.config(parse("--response-role", "bot")).response_role == "bot"


@pytest.mark.parametrize("argv,message", [
    (["--mqtt", "http://127.0.0.1:1"], "--mqtt: expected mqtt://host:port"),
    (["--mqtt", "mqtt://h:99999"], "--mqtt: expected mqtt://host:port, got 'mqtt://h:99999' (Port out"),
    (["--mqtt", "mqtt://h:abc"], "--mqtt: expected mqtt://host:port"),
    (["--mqtt", "mqtt://[::1"], "--mqtt: expected mqtt://host:port"),
    (["--max-group", "0"], "--max-group"),
    (["--response-role", " "], "--response-role must name a role"),
    (["--barrier-timeout-ms", "-1"], "--barrier-timeout-ms"),
    (["--offload-gib", "-2"], "--offload-gib"),
    (["--drain-timeout", "-1"], "--drain-timeout"),
    (["--barrier-timeout-ms", "nan"], "--barrier-timeout-ms"),
    (["--offload-gib", "inf"], "--offload-gib"),
    (["--offload-gib", "nan"], "--offload-gib"),
    (["--anchor-gib", "-1"], "--anchor-gib must be a finite number, not negative"),
    (["--anchor-rank", "0"], "--anchor-rank must be at least 1"),
    (["--drain-timeout", "nan"], "--drain-timeout"),
    (["--port", "65536"], "--port must lie in 0..65535"),
    (["--port", "-5"], "--port"),
    (["--api-key", ""], "--api-key: a key is a non-empty string"),
    (["--api-key", "two words"], "--api-key: a key is a non-empty string without whitespace"),
    (["--served-model-name", "a", "a"], "--served-model-name: give each name once"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in (0, 1]"),
    (["--mqtt-peers"], "--mqtt-peers shares rounds over the MQTT broker: give --mqtt too"),
    (["--stream-interval", "0"], "--stream-interval must be at least 1"),
    (["--gpu-memory-utilization", "0.5", "--kv-tokens", "4096"], "--kv-tokens and --gpu-memory-utilization"),
    (["/m/a", "--model", "/m/b"], "MODEL /m/a and --model /m/b name two models: give one"),
    (["--mode", "full", "--enable-prefix-caching"], "--mode full reuses no KV: not with --enable-prefix-caching"),
    (["--mode", "pic", "--no-enable-prefix-caching"], "--no-enable-prefix-caching reuses no KV: not with --mode pic"),
    (["/m/a", "--engine", "http://127.0.0.1:1"], "MODEL set the engine: with --engine, give them to"),
])
def test_bad_flags_fail_in_one_line_before_loading_the_model(monkeypatch, capsys, argv, message):
    def never(args):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(serve, "load_backend", never)
    assert cli.main(["serve", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize("argv", [["/m/a"], ["--model", "/m/a"], ["/m/a", "--model", "/m/a"]])
def test_the_model_is_given_as_vllm_serve_takes_it_or_by_flag(monkeypatch, capsys, argv):
    seen = []

    def load(args):
        seen.append(engine_options(args)["model"])
        raise ValueError("loaded no further")

    monkeypatch.setattr(serve, "load_backend", load)
    assert cli.main(["serve", *argv]) == 1
    assert seen == ["/m/a"] and "loaded no further" in capsys.readouterr().err


def test_importing_serve_does_not_load_torch():
    code = "import sys, tokendance.proxy.serve; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def healthy(proc: subprocess.Popen, url: str, seconds: float) -> None:
    """Wait until the server process answers /health (its output if it dies first)."""
    end = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < end, proc.stdout.read()
            time.sleep(0.05)


def test_sigterm_drains_the_request_in_flight(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(FAKE), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        healthy(proc, url, 30)
        words = " ".join(f"w{i}" for i in range(30))
        body = json.dumps({"model": "fake-tiny", "messages": [{"role": "user", "content": words}]})
        req = urllib.request.Request(url + "/v1/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(json.load(urllib.request.urlopen(req, timeout=10))))
        t.start()
        time.sleep(0.2)  # the answer takes 30 x 20 ms
        proc.send_signal(signal.SIGTERM)
        t.join(10)
        assert result["choices"][0]["message"]["content"] == words
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("argv,mode", [
    ([], None), (["--enable-prefix-caching"], None), (["--mode", "prefix", "--enable-prefix-caching"], "prefix"),
    (["--no-enable-prefix-caching"], "full"), (["--mode", "full", "--no-enable-prefix-caching"], "full")])
def test_vllms_prefix_caching_flag_sets_the_mode(monkeypatch, argv, mode):
    seen = []

    def load(args):
        seen.append(args.mode)
        raise ValueError("loaded no further")

    monkeypatch.setattr(serve, "load_backend", load)
    assert cli.main(["serve", *argv]) == 1
    assert seen == [mode]


@pytest.mark.parametrize("flag", ["-tp", "-dp"])
def test_a_server_over_two_processes_answers_as_one_and_stops_them(tiny_llama, flag):
    """`serve -tp 2` (one engine split over two processes) and `serve -dp 2` (two engines,
    a session on each) on the CPU: one process's answers; a terminal's ^C (SIGINT to the
    whole process group) ends every process, quietly."""
    from tokendance.backend.api import SamplingParams
    from tokendance.backend.engine import Engine

    want = Engine(model=str(tiny_llama), dtype="float32").generate(
        [[1, 2, 3, 4]], SamplingParams(max_tokens=6, temperature=0))[0][0]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokendance.examples.cli", "serve", "--model", str(tiny_llama),
                             "--dtype", "float32", flag, "2", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        healthy(proc, url, 120)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children  # the follower or the engines (and multiprocessing's resource tracker)
        body = json.dumps({"model": str(tiny_llama), "prompt": [1, 2, 3, 4], "max_tokens": 6, "temperature": 0,
                           "return_token_ids": True}).encode()
        for session in ("s1", "s2"):
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json",
                                                                         "X-TokenDance-Session": session})
            assert json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["token_ids"] == want
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        pinned = [line.rsplit(" ", 1)[1] for line in metrics.splitlines()
                  if line.startswith("tokendance_engine_fleet_sessions{")]
        assert pinned == ([] if flag == "-tp" else ["1", "1"])  # two engines: a session on each
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert "Traceback" not in out and "error" not in out, out
        end = time.monotonic() + 10
        while any(Path(f"/proc/{c}").exists() for c in children):
            assert time.monotonic() < end, "a process outlived the server"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_data_parallel_engines_start_here(monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_backend", lambda args: pytest.fail("nothing may start"))
    assert cli.main(["serve", "-dp", "2", "--engine", "http://127.0.0.1:9"]) == 1
    assert capsys.readouterr().err.strip() == ("tokendance serve: --data-parallel-size starts engines here: "
                                               "not with --engine or --vllm")


def test_a_data_parallel_engine_that_cannot_start_is_one_line(tiny_llama, capsys):
    from tokendance.examples.cli import main

    code = main(["serve", "--model", str(tiny_llama), "--port", "0", "-dp", "2", "-tp", "3"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and re.fullmatch(r"tokendance serve: data-parallel engine [01]: --tensor-parallel-size 3 "
                                      r"does not divide the model's 4 attention heads", err)  # whichever told first


def test_served_model_names_and_api_keys(monkeypatch):
    """vLLM's --served-model-name (requests may give any name, answers the first) and
    --api-key (repeatable, or $TOKENDANCE_API_KEY, else vLLM's $VLLM_API_KEY; /v1 routes only)."""
    monkeypatch.setenv(serve.VLLM_KEY_ENV, "sk-vllm")
    assert serve.config(parse()).api_keys == {"sk-vllm"}
    monkeypatch.setenv(serve.KEY_ENV, "sk-env")
    assert serve.config(parse()).api_keys == {"sk-env"}
    c = serve.config(parse("--api-key", "sk-a", "--api-key", "sk-b", "--served-model-name", "gpt-4o-mini", "tiny"))
    assert c.api_keys == {"sk-a", "sk-b"} and c.names == ("gpt-4o-mini", "tiny")
    t = Threaded(FakeBackend(), names=c.names, api_keys=c.api_keys)
    try:
        _names_and_keys(t.url)
    finally:
        t.close()


def _names_and_keys(url: str) -> None:
    import openai

    ok = openai.OpenAI(base_url=url + "/v1", api_key="sk-b", max_retries=0)
    assert [m.id for m in ok.models.list()] == ["gpt-4o-mini", "tiny"]
    assert [m.root for m in ok.models.list()] == ["fake-tiny"] * 2  # the model behind the names, as vLLM says
    r = ok.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a b"}])
    assert r.model == "gpt-4o-mini" and r.choices[0].message.content == "a b"
    assert ok.responses.create(model="gpt-4o-mini", input="c d").model == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError):
        ok.chat.completions.create(model="fake-tiny", messages=[{"role": "user", "content": "x"}])
    for key in ("sk-wrong", "sk-"):
        bad = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/tokendance/sessions/s/rounds/1", "/score", "/rerank", "/v2/rerank", "/pooling",
                 "/generative_scoring"):
        req = urllib.request.Request(url + path, data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)  # the control routes and the scores too
        assert e.value.code == 401, path
    assert json.load(urllib.request.urlopen(url + "/health"))["model"] == "gpt-4o-mini"  # open


def test_a_chat_template_replaces_the_tokenizers(tiny_llama, tmp_path):
    from tokendance.backend.service import EngineBackend

    be = EngineBackend.load(str(tiny_llama), dtype="float32")
    text = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
    (tmp_path / "t.jinja").write_text(text)
    serve.chat_template(be, str(tmp_path / "t.jinja"))
    assert be.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi</user><assistant>"
    serve.chat_template(be, "{{ messages[0].content }}!")  # the template itself
    assert be.render_chat([{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(ValueError, match="no such file: /nope.jinja"):
        serve.chat_template(be, "/nope.jinja")
    with pytest.raises(ValueError, match="--chat-template cannot render a chat"):
        serve.chat_template(be, "{{ raise_exception('no system messages') }}")


def test_a_tool_call_parser_the_template_cannot_take_is_one_line_at_start(monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_backend", lambda args: FakeBackend())  # it renders no tools
    monkeypatch.setattr(serve, "serve", lambda *a: pytest.fail("the server must not start"))
    assert cli.main(["serve", "--tool-call-parser", "llama3_json"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--tool-call-parser llama3_json: the chat template renders no tools" in err and "\n" not in err


def test_a_chat_template_needs_a_tokenizer(monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_backend", lambda args: FakeBackend())  # it renders without one
    assert cli.main(["serve", "--chat-template", "{{ x }}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("--chat-template: the fake-tiny backend renders no chats") and "\n" not in err


def test_the_server_serves_with_its_startup_heap_frozen(monkeypatch):
    import contextlib

    calls = []

    @contextlib.contextmanager
    def frozen():
        calls.append("freeze")
        yield 1
        calls.append("unfreeze")

    monkeypatch.setattr(serve, "load_backend", lambda args: FakeBackend())
    monkeypatch.setattr(serve.heap, "frozen", frozen)

    async def served(server, where):
        calls.append("serve")

    monkeypatch.setattr(serve, "serve", served)
    assert cli.main(["serve"]) == 0
    assert calls == ["freeze", "serve", "unfreeze"]
