"""Refuse what a web page could make a browser send here: cross-site requests and DNS rebinding.

Any page the operator opens can make the browser send requests to http://127.0.0.1:30000 (a form post needs no
CORS preflight), and a page on a domain the attacker points at 127.0.0.1 (DNS rebinding) is even "same origin".
So, on every route:
- Host must name this machine: an IP address, localhost, this machine's host name, the --host value, or a
  name in --allowed-origins. A rebinding attack always arrives with the attacker's domain in Host.
- Origin, when present (browsers add it to cross-origin requests and to every POST), must be this server's own
  origin (its host:port equals Host) or be listed in --allowed-origins.
Clients that are not browsers (curl, the openai client, sglang-router, Prometheus) send no Origin and address
the server by IP or by its name, so they pass. ``--allowed-origins '*'`` turns the guard off.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from tierlm.server.http.errors import send_error

logger = logging.getLogger("tierlm.server")


def _host_name(host_header: str) -> str:
    """'example.com:30000' -> 'example.com', '[::1]:30000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def machine_names(bind_host: str) -> set[str]:
    names = {"localhost", bind_host.lower()}
    try:
        names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
    except OSError:  # no resolver: the IP addresses and localhost still work
        pass
    return names


class OriginGuardMiddleware:
    def __init__(self, app: ASGIApp, bind_host: str, allowed_origins: list[str]) -> None:
        self.app = app
        self.disabled = "*" in allowed_origins
        self.allowed_origins = {o.rstrip("/").lower() for o in allowed_origins if "://" in o}
        self.allowed_hosts = machine_names(bind_host) | {o.lower() for o in allowed_origins if "://" not in o}
        self.allowed_hosts |= {_host_name(urlsplit(o).netloc) for o in self.allowed_origins}

    def _host_allowed(self, host_header: str) -> bool:
        name = _host_name(host_header)
        return _is_ip(name) or name in self.allowed_hosts or name.endswith(".localhost")

    def _origin_allowed(self, origin: str, host_header: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if origin in self.allowed_origins:
            return True
        netloc = urlsplit(origin).netloc
        return bool(netloc) and netloc == host_header.strip().lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.disabled:
            await self.app(scope, receive, send)
            return
        headers = {k.decode(): v.decode("latin-1") for k, v in scope.get("headers", []) if k in (b"host", b"origin")}
        host, origin = headers.get("host"), headers.get("origin")
        problem = None
        if host is not None and not self._host_allowed(host):
            problem = (f"Host '{host}' does not name this server (possible DNS rebinding); if clients reach the "
                       f"server under that name, restart it with --allowed-origins {_host_name(host)}")
        elif origin is not None and not self._origin_allowed(origin, host or ""):
            problem = (f"requests from the web page at origin '{origin}' are not allowed; to let that page use "
                       f"this server, restart it with --allowed-origins {origin}")
        if problem is None:
            await self.app(scope, receive, send)
            return
        logger.warning("refused %s %s: %s", scope.get("method"), scope.get("path"), problem)
        await send_error(send, problem, 403, code="origin_not_allowed")
