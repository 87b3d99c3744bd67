"""What the server refuses before a request reaches an endpoint: the browser's ways in, and slow clients.

A server on this machine is reachable by every web page its user opens. Three checks keep a page
from driving it (the threat model is in docs/server.md):

- **Host**: a page that rebinds its own domain name to 127.0.0.1 (DNS rebinding) sends its own
  name as `Host`. The server answers only an IP literal it is bound to (any, when bound to a
  wildcard address), `localhost`, or a name given with `--allowed-hosts` (421 otherwise).
- **Origin**: a browser names the page's origin on every cross-origin request. A request whose
  `Origin` is neither the server's own nor one of `--allowed-origins` is refused (403), and only
  the allowed origins get CORS headers (preflights answered by starlette's CORSMiddleware).
- **Content type**: a POST must say `application/json` (415 otherwise). A page can send
  `text/plain` cross-origin without a preflight; it cannot send `application/json` without one.

`GuardedH11` bounds slow clients at the connection: the request's headers must arrive within
`header_timeout_s` of the connection (or of the previous response), and beyond
`max_connections` open connections a new one gets a 503 and is closed at once.
"""

from __future__ import annotations

import ipaddress
import json
import weakref
from collections.abc import Iterable

from uvicorn.protocols.http.h11_impl import H11Protocol

LOOPBACK_NAMES = ("localhost",)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def split_host(value: str) -> str:
    """The host of a Host header or an origin's authority, without its port, lower-case."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1: value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


class Policy:
    """Which hosts and origins a server bound to `bound` answers."""

    def __init__(self, bound: str, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()) -> None:
        self.bound = _ip(bound)
        self.any_host = "*" in allowed_hosts
        self.hosts = {split_host(h) for h in allowed_hosts if h != "*"}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if o != "*"}

    def host_allowed(self, host: str) -> bool:
        name = split_host(host)
        if self.any_host or name in self.hosts:
            return True
        ip = _ip(name)
        if ip is None:
            return name in LOOPBACK_NAMES and (self.bound is None or self.bound.is_loopback or
                                               self.bound.is_unspecified)
        if self.bound is None or self.bound.is_unspecified:
            return True  # an IP literal cannot be a rebound name
        return ip == self.bound or (self.bound.is_loopback and ip.is_loopback)

    def origin_allowed(self, origin: str, host: str) -> bool:
        """An allowed origin, or the server's own (a page it served itself)."""
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        scheme, _, authority = origin.partition("://")
        return scheme in ("http", "https") and bool(authority) and authority == host.strip().lower()

    @property
    def cors_origins(self) -> list[str]:
        return ["*"] if self.any_origin else sorted(self.origins)


class Guard:
    """ASGI middleware: Host, Origin and content type checked before the app sees the request."""

    def __init__(self, app, policy: Policy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            return await _refuse(send, 421, f"the Host {host[:80]!r} is not this server's (give it with "
                                            "--allowed-hosts to answer it)", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_allowed(origin, host):
            return await _refuse(send, 403, f"requests from the origin {origin[:80]!r} are not allowed (give it with "
                                            "--allowed-origins to allow it)", "origin_not_allowed")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return await _refuse(send, 415, f"Content-Type {kind[:60] or '(none)'!r}: expected application/json",
                                     "unsupported_media_type")
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers and a cap on connections."""

    header_timeout_s = 10.0
    max_connections = 512

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n"
                            b"Retry-After: 1\r\n\r\n")
            transport.close()
            return
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        waiting_for = self.cycle  # a request whose headers arrive replaces the cycle
        self.loop.call_later(self.header_timeout_s, self._header_deadline, waiting_for)

    def _header_deadline(self, waiting_for) -> None:
        if self.cycle is waiting_for and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedH11]:
    return type("GuardedH11", (GuardedH11,), {"header_timeout_s": header_timeout_s,
                                              "max_connections": max_connections})


# ---------------------------------------------------------------------- a prompt's size before its rendering
_longest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token of the vocabulary stands for (computed once per tokenizer)."""
    found = _longest.get(tokenizer)
    if found is None:
        found = max((len(tokenizer.token_str(i).encode("utf-8", "surrogatepass")) for i in range(tokenizer.vocab_size)),
                    default=1)
        _longest[tokenizer] = found = max(1, found)
    return found


def check_prompt_size(tokenizer, n_ctx: int, texts: Iterable[str], param: str = "messages") -> None:
    """400 (context_length_exceeded) for text that cannot fit the context whatever its tokens: every token
    stands for at most `longest_token_bytes` bytes, so text of more bytes than n_ctx times that is over the
    horizon. Checked before the conversation is rendered and tokenised (that work grows with the text)."""
    from hybridlm.server.wire import invalid

    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    most = n_ctx * longest_token_bytes(tokenizer)
    if size > most:
        raise invalid(f"This model's maximum context length is {n_ctx} tokens; your {param} hold {size:,} bytes of "
                      f"text, more than {n_ctx} tokens of this vocabulary can hold ({most:,})", param=param,
                      code="context_length_exceeded")
