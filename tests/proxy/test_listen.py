"""Where `tokendance serve` listens, as `vllm serve` takes it: HTTPS (--ssl-keyfile,
--ssl-certfile, clients' certificates with --ssl-ca-certs and --ssl-cert-reqs) and a Unix
socket (--uds); bad flags are one line before the model loads."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from tokendance.examples import cli
from tokendance.proxy import serve
from tokendance.proxy.listen import listen
from tokendance.proxy.server import Server

from .conftest import FakeBackend
from .test_serve import parse

MSGS = [{"role": "user", "content": "hello there"}]


def certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl's command line)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("certs")
    return {name: certificate(folder, name) for name in ("server", "client", "stranger")}


async def started(*argv: str) -> Server:
    server = Server(FakeBackend())
    await server.start(listen(parse("--port", "0", *argv)))
    return server


def trusting(cert: Path, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cert))
    if client is not None:
        ctx.load_cert_chain(*map(str, client))
    return ctx


async def chat(url: str, http: httpx.AsyncClient) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, http_client=http)
    out = await client.chat.completions.create(model="fake-tiny", messages=MSGS, max_tokens=3)
    return out.choices[0].message.content


async def test_https_serves_the_openai_sdk(certs):
    cert, key = certs["server"]
    server = await started("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        assert server.url.startswith("https://127.0.0.1:")
        async with httpx.AsyncClient(verify=trusting(cert)) as http:
            assert await chat(server.url, http)
        plain = server.url.replace("https://", "http://")
        async with httpx.AsyncClient() as http:  # plain HTTP to the TLS port is no answer
            with pytest.raises(httpx.HTTPError):
                await http.get(plain + "/health")
        stranger = certs["stranger"][0]  # a client that trusts another certificate refuses it
        async with httpx.AsyncClient(verify=trusting(stranger)) as http:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await http.get(server.url + "/health")
    finally:
        await server.stop()


@pytest.mark.parametrize("reqs", [1, 2])
async def test_client_certificates_checked_against_the_ca_certs(certs, reqs):
    cert, key = certs["server"]
    server = await started("--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                           "--ssl-ca-certs", str(certs["client"][0]), "--ssl-cert-reqs", str(reqs))
    try:
        async with httpx.AsyncClient(verify=trusting(cert, certs["client"])) as http:
            assert await chat(server.url, http)
        async with httpx.AsyncClient(verify=trusting(cert, certs["stranger"])) as http:
            with pytest.raises(httpx.HTTPError):  # a certificate the CA certs do not vouch for
                await http.get(server.url + "/health")
        async with httpx.AsyncClient(verify=trusting(cert)) as http:  # none: optional (1) lets it in
            if reqs == 1:
                assert (await http.get(server.url + "/health")).status_code == 200
            else:
                with pytest.raises(httpx.HTTPError):
                    await http.get(server.url + "/health")
    finally:
        await server.stop()


async def test_a_unix_socket_serves_the_openai_sdk(tmp_path):
    sock = tmp_path / "td.sock"
    server = await started("--uds", str(sock), "--port", "1")  # --uds sets host and port aside
    try:
        assert sock.is_socket() and server.port == 0
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock))) as http:
            assert await chat(server.url, http)
            assert (await http.get(server.url + "/v1/models")).json()["data"][0]["id"] == "fake-tiny"
    finally:
        await server.stop()


@pytest.mark.parametrize("argv,message", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile serve HTTPS together: give both"),
    (["--ssl-certfile", "c.pem"], "--ssl-keyfile and --ssl-certfile serve HTTPS together: give both"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs and --ssl-cert-reqs check clients of an HTTPS server"),
    (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0, 1 or 2"),
    (["--ssl-keyfile", "{key}", "--ssl-certfile", "{cert}", "--ssl-cert-reqs", "2"],
     "--ssl-cert-reqs 2 checks clients' certificates: give --ssl-ca-certs"),
    (["--ssl-keyfile", "{key}", "--ssl-certfile", "/no/cert.pem"], "--ssl-certfile /no/cert.pem: no such file"),
    (["--ssl-keyfile", "{cert}", "--ssl-certfile", "{cert}"], "not a certificate and its key"),
    (["--ssl-keyfile", "{key}", "--ssl-certfile", "{cert}", "--ssl-ca-certs", "{key}"],
     "--ssl-ca-certs {key}: no CA certificates in it"),
    (["--uds", "/no/such/folder/td.sock"], "--uds /no/such/folder/td.sock: no such folder"),
    (["--uds", "{dir}/td.sock", "--ssl-keyfile", "{key}", "--ssl-certfile", "{cert}"],
     "--uds serves plain HTTP on a local socket: not with --ssl-keyfile"),
])
def test_bad_flags_are_one_line_before_the_model_loads(monkeypatch, capsys, certs, argv, message):
    cert, key = certs["server"]

    def never(args):
        raise AssertionError("the model must not load")

    fill = dict(cert=cert, key=key, dir=cert.parent)
    monkeypatch.setattr(serve, "load_backend", never)
    assert cli.main(["serve", *(a.format(**fill) for a in argv)]) == 1
    err = capsys.readouterr().err.strip()
    assert message.format(**fill) in err and "\n" not in err
