"""Where the proxy listens, as `vllm serve` takes it: a host and port, over TLS with
--ssl-keyfile and --ssl-certfile (clients' certificates checked against --ssl-ca-certs
as --ssl-cert-reqs asks), or a Unix socket (--uds, which sets host and port aside)."""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

CERT_REQS = (0, 1, 2)  # the ssl module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED


@dataclass(frozen=True, slots=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8000
    tls: ssl.SSLContext | None = None
    uds: str | None = None

    def site(self, runner: web.AppRunner) -> web.BaseSite:
        if self.uds is not None:
            return web.UnixSite(runner, self.uds)
        return web.TCPSite(runner, self.host, self.port, ssl_context=self.tls)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="serve on this Unix socket instead of a host and port")
    p.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS: the server's private key")
    p.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS: the server's certificate")
    p.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="the CA certificates that clients' certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                   help="whether clients must show a certificate: 0 no, 1 if they have one, 2 yes "
                        "(the ssl module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)")


def listen(args: argparse.Namespace) -> Listen:
    """The flags as a Listen; ValueError, one line, for a bad one (before the model loads)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in 0..65535, got {args.port}")
    if args.ssl_cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2 (ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED), "
                         f"not {args.ssl_cert_reqs}")
    given = [f for f in ("keyfile", "certfile", "ca_certs") if getattr(args, f"ssl_{f}") is not None]
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile serve HTTPS together: give both")
    if args.ssl_keyfile is None and (given or args.ssl_cert_reqs):
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs check clients of an HTTPS server: "
                         "give --ssl-keyfile and --ssl-certfile too")
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {args.ssl_cert_reqs} checks clients' certificates: "
                         "give --ssl-ca-certs to check them against")
    if args.uds is not None:
        if args.ssl_keyfile is not None:
            raise ValueError("--uds serves plain HTTP on a local socket: not with --ssl-keyfile")
        if not Path(args.uds).expanduser().parent.is_dir():
            raise ValueError(f"--uds {args.uds}: no such folder for the socket")
    for f in given:
        path = getattr(args, f"ssl_{f}")
        if not os.path.isfile(os.path.expanduser(path)):
            raise ValueError(f"--ssl-{f.replace('_', '-')} {path}: no such file")
    return Listen(args.host, args.port, tls(args) if args.ssl_keyfile else None,
                  None if args.uds is None else str(Path(args.uds).expanduser()))


def tls(args: argparse.Namespace) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(os.path.expanduser(args.ssl_certfile), os.path.expanduser(args.ssl_keyfile))
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile {args.ssl_certfile} with --ssl-keyfile {args.ssl_keyfile}: "
                         f"not a certificate and its key ({e.strerror or e})") from None
    if args.ssl_ca_certs is not None:
        try:
            ctx.load_verify_locations(os.path.expanduser(args.ssl_ca_certs))
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs {args.ssl_ca_certs}: no CA certificates in it "
                             f"({e.strerror or e})") from None
    ctx.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return ctx
