"""API keys: `Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's clients send it) on every endpoint
but /health (load balancers) and the chat page's HTML (it holds no data and asks for the key itself); /metrics
too unless --metrics-public.

Keys come from --api-key and --api-key-file (one per line, `#` comments, also after a key; several users, each with
their own key).
A key past ASCII is taken as its UTF-8 bytes or, for characters up to U+00FF, as their Latin-1 bytes (a browser's
fetch sends those): `clé` works from curl and from the chat page alike.
The check hashes the sent key and compares the digest with every key's digest, always all of them, with
hmac.compare_digest: the time taken says nothing about how much of a key matched, nor which key. A 401 never
echoes what was sent. It runs as ASGI middleware before the body is read, so a client without a key cannot make
the server read (or parse) a large body.

Cross-origin requests from browsers (CORS, `allow_cross_origin`): as ollama, pages served from this machine
(http(s)://localhost, 127.0.0.1, [::1], 0.0.0.0 on any port; app://, file://, tauri://, vscode-webview://) may
call the API from their scripts, and `--cors-origin ORIGIN` adds others (`*`: any; a pattern in the forms
OLLAMA_ORIGINS takes: `chrome-extension://*`, `https://*.example.com`, `http://host:*`). A request that names another
origin is refused with a 403 before it runs (`OriginGuard`, as ollama's CORS middleware does): the browser's CORS
only hides the answer, and a page the user merely visits could otherwise send a "simple" POST (text/plain, no
preflight) that runs a generation, loads or deletes a model. On a server listening on loopback only, the Host
header must name this machine too (DNS rebinding: a site whose name comes to point at 127.0.0.1 is then same
origin; ollama's allowed hosts). Preflights are answered before the key check (browsers send them without
credentials); the answers carry the CORS headers, 401s included, so a page can read why it was refused.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import ipaddress
import re
import socket
from typing import Iterable

from .limits import send_error

OPEN_PATHS = ("/health", "/v1/health")
# ollama's default origins: this machine's pages and local app shells
LOCAL_ORIGINS = (r"https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?"
                 r"|(app|file|tauri|vscode-webview|vscode-file)://.*")
PAGE_PATHS = ("/",)


def read_key_file(path: str) -> list[str]:
    """Keys from a file: one per line; blank lines and lines starting with # are skipped, and a # after whitespace
    starts a comment (`k2  # bob` is the key k2; a # inside a key, `k#2`, is part of it). A key that still holds
    whitespace is refused, by its line number (never the key itself: it is a secret): no client sends one."""
    from ..engine.errors import BitNetError
    from ..engine.fileio import decode_text
    try:
        with open(path, "rb") as f:   # (a FIFO too: `--api-key-file <(pass show key)`)
            # a leading BOM dropped (the first key is the key typed); lines as a text-mode file splits them
            lines = list(io.StringIO(decode_text(f.read()), newline=None))
    except OSError as e:
        raise BitNetError(f"--api-key-file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise BitNetError(f"--api-key-file {path}: {e}") from None
    keys = []
    for n, line in enumerate(lines, 1):
        key = re.split(r"\s#", line.strip(), maxsplit=1)[0].strip()
        if not key or key.startswith("#"):
            continue
        if any(c.isspace() for c in key):
            raise BitNetError(f"--api-key-file {path}: line {n} holds a key with whitespace in it",
                              hint="one key per line; a comment after a key starts with whitespace and #")
        keys.append(key)
    if not keys:
        raise BitNetError(f"--api-key-file {path}: no keys in it", hint="one key per line")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _sent_forms(key: str) -> list[bytes]:
    """The bytes a key may arrive as: its UTF-8 (curl, the SDKs), and, for a key of characters up to U+00FF
    beyond ASCII (clé), their Latin-1, one byte each: what a browser's fetch puts in a header (headers are
    byte strings there), the chat page's included. A key past U+00FF can come as UTF-8 only."""
    forms = [key.encode("utf-8")]
    if not key.isascii():
        try:
            forms.append(key.encode("latin-1"))
        except UnicodeEncodeError:
            pass
    return forms


class KeyChecker:
    def __init__(self, keys: Iterable[str]):
        keys = list(keys)
        self._n = len(keys)
        self._digests = [_digest(form) for k in keys for form in _sent_forms(k)]

    def __bool__(self):
        return bool(self._digests)

    def __len__(self):
        return self._n

    def ok(self, authorization: bytes | None, x_api_key: bytes | None = None) -> bool:
        """authorization: the `Authorization` header ("Bearer KEY"); x_api_key: the `x-api-key` header, which
        Anthropic's clients send instead (taken when the Authorization header holds no Bearer key: a proxy's
        Basic credentials, say, nginx's auth_basic passes on)."""
        raw = authorization or b""
        sent = raw[7:].strip() if raw[:7].lower() == b"bearer " else b""
        if not sent and x_api_key is not None:
            sent = x_api_key.strip()
        d = _digest(sent)
        found = False
        for want in self._digests:   # every key, every time
            found |= hmac.compare_digest(d, want)
        return found and bool(sent)


class AuthMiddleware:
    def __init__(self, app, checker: KeyChecker, metrics_public: bool = False):
        self.app, self.checker, self.metrics_public = app, checker, metrics_public

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.checker:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if scope.get("method") in ("GET", "HEAD") and (path in OPEN_PATHS or path in PAGE_PATHS or
                                                        (path == "/metrics" and self.metrics_public)):
            return await self.app(scope, receive, send)   # the open ones are reads: a POST there needs the key
        headers = scope.get("headers", ())
        auth = next((v for k, v in headers if k == b"authorization"), None)
        x_key = next((v for k, v in headers if k == b"x-api-key"), None)
        if not self.checker.ok(auth, x_key):
            return await send_error(send, scope, 401, "invalid or missing API key (send 'Authorization: Bearer KEY'"
                                    " or 'x-api-key: KEY')",
                                    "authentication_error", "invalid_api_key",
                                    headers=((b"www-authenticate", b"Bearer"),))
        return await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether a listening address (--host) is this machine only."""
    if host.lower() in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _local_host(host: str) -> bool:
    """A Host header naming this machine (ollama's allowed hosts): an IP that is loopback, private or unspecified,
    localhost, this machine's name, or a name under .localhost / .local / .internal; no Host at all (HTTP/1.0);
    a name of one label (no dot: a short name of this network, never one a web site can point here)."""
    host = host.strip().lower()
    if not host:
        return True
    name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0] \
        if host.count(":") == 1 else host
    try:
        ip = ipaddress.ip_address(name)
        return ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_link_local
    except ValueError:
        pass
    return "." not in name or name.endswith((".localhost", ".local", ".internal")) or \
        name == socket.gethostname().lower()


class OriginGuard:
    """403 for a browser request from an origin that may not call this server (CORS' headers alone leave the
    request run), and, on a loopback-only server, for a Host that is not this machine (DNS rebinding). A request
    without Origin (curl, the SDKs) passes; so does one from the page's own origin (the chat page; a proxy's
    X-Forwarded-Host counts as the page's host)."""

    def __init__(self, app, origins: tuple = (), local_only: bool = False):
        self.app, self.origins, self.local_only = app, origins, local_only
        self.any = "*" in origins
        # the sites named by --cors-origin are this server's names too (a proxy that passes its Host on); of a
        # pattern, an http(s) one of a domain's subdomains (https://*.example.com) only: an extension's "host" is
        # its id, and chrome-extension://* named every Host (DNS rebinding let in)
        self.hosts = {o.split("://", 1)[1].lower() for o in origins if "://" in o and "*" not in o}
        self.wild = wildcard_regex(origins)
        self.wild_hosts = wildcard_regex(origins, hosts=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or ()
        host = next((v for k, v in headers if k == b"host"), b"").decode("latin-1")
        if self.local_only and not self.any and not _local_host(host) and host.lower() not in self.hosts and \
                host.lower().rsplit(":", 1)[0] not in self.hosts and \
                not (self.wild_hosts and self.wild_hosts.fullmatch(host)):
            return await send_error(send, scope, 403, f"Host {host[:100]!r} is not this machine: refused (this "
                                    "server listens on loopback only, and a web page whose name points here is not "
                                    "let in; behind a proxy, have it send Host localhost, or start the server with "
                                    "--cors-origin https://THAT-NAME, or with --api-key)", "permission_error",
                                    "forbidden_host")
        origin = next((v for k, v in headers if k == b"origin"), None)
        if origin is None or self.any:
            return await self.app(scope, receive, send)
        origin = bare_origin(origin.decode("latin-1"))
        netloc = origin.split("://", 1)[1] if "://" in origin else None
        forwarded = next((v for k, v in headers if k == b"x-forwarded-host"), b"").decode("latin-1")
        if re.fullmatch(LOCAL_ORIGINS, origin) or origin in self.origins or \
                (self.wild is not None and self.wild.fullmatch(origin)) or \
                (netloc is not None and netloc.lower() in (host.lower(), forwarded.split(",")[0].strip().lower())):
            return await self.app(scope, receive, send)
        allow = (f"{origin[:100]} to allow that origin" if check_origin(origin) is None else
                 "'*' to allow any origin: no value names that one alone")
        return await send_error(send, scope, 403, f"a page from {origin[:100]} may not call this server (start it "
                                f"with --cors-origin {allow})", "permission_error", "forbidden_origin")


def bare_origin(origin: str) -> str:
    """An origin without a trailing "/" (some clients send one), but never cut into its scheme: an app shell's page
    from disk sends `file://`, which stripped to `file:` matched none of the local origins (a 403 after a preflight
    that said yes)."""
    while origin.endswith("/") and not origin.endswith("://"):
        origin = origin[:-1]
    return origin


def allow_cross_origin(app, origins=(), local_only: bool = False, keyed: bool = False):
    """Starlette's CORS middleware (the standard one) on `app`, outermost: call it after every other middleware;
    OriginGuard just inside it, unless the server needs a key (keyed: a page of another site, or one whose name
    was made to point here, has no key; its request is a 401 anyway). origins: origins allowed beside the local
    ones; "*" allows any. local_only: the server listens on loopback only (OriginGuard's Host check)."""
    import inspect

    from starlette.middleware.cors import CORSMiddleware
    extra = tuple(o.rstrip("/") for o in origins)
    if not keyed:
        app.add_middleware(OriginGuard, origins=extra, local_only=local_only)
    kw = {}
    if "allow_private_network" in inspect.signature(CORSMiddleware.__init__).parameters:
        kw["allow_private_network"] = True   # Chrome's preflight for a public page calling a private address
    wild = wildcard_regex(extra)
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if "*" in extra else [o for o in extra if "*" not in o],
                       allow_origin_regex=None if "*" in extra else
                       LOCAL_ORIGINS + ("" if wild is None else "|" + wild.pattern),
                       allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                       expose_headers=["Retry-After", "X-Bitnet-Instance"], max_age=600, **kw)


def check_origin(origin: str) -> str | None:
    """What is wrong with a --cors-origin value, or None. `null` is the origin browsers send for a sandboxed
    iframe, a file:// page or a redirect across sites: the 403 for it says to name it, so it is one. A value with
    a `*` is a pattern (_pattern_regex): the forms OLLAMA_ORIGINS is given, any other is refused."""
    if origin in ("*", "null"):
        return None
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+/?", origin):
        return "not an origin (scheme://host[:port], e.g. https://app.example.com; null; or * for any)"
    if "*" in origin and _pattern_regex(origin.rstrip("/")) is None:
        return ("a wildcard only as scheme://* (any origin of that scheme: chrome-extension://*), "
                "scheme://*.DOMAIN (its subdomains: https://*.example.com) or a port :* (http://HOST:*, "
                "http://[IPv6 address]:*)")
    return None


# a host name's label (a browser sends an origin's host in lower case; a pattern's domain is matched regardless)
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?"


def _pattern_regex(pattern: str, hosts: bool = False) -> str | None:
    """The regex of a --cors-origin pattern (re.fullmatch, case-insensitive host), None for a form it does not
    take. As OLLAMA_ORIGINS is written, and no looser: scheme://* is any origin of that scheme (an extension's
    id, a port), scheme://*.DOMAIN one of DOMAIN's subdomains (not DOMAIN itself, nor evil-DOMAIN, nor
    DOMAIN.evil.org), HOST:* that host on any port (or none), an IPv6 literal too ([fd00::5]:*). hosts: the regex
    of a Host header the pattern names (a proxy passing its site's Host on): an http(s) domain pattern's alone, None
    for any other."""
    scheme, _, authority = pattern.partition("://")
    if "*" in scheme:
        return None
    host, port = authority, None
    if authority.startswith("["):   # an IPv6 literal: [fd00::5], [fd00::5]:*, [fd00::5]:8080
        m = re.fullmatch(r"\[([^\]]+)\](?::(\*|\d+))?", authority)
        if m is None:
            return None
        try:   # as a browser writes it in an origin: compressed, lower case (so [FD00:0::5] is [fd00::5])
            host = "[" + ipaddress.IPv6Address(m.group(1)).compressed + "]"
        except ValueError:
            return None
        port = m.group(2)
    elif authority.count(":") == 1:
        host, port = authority.split(":")
    if port is not None and port != "*" and not port.isdigit():
        return None
    port_rx = "" if port is None else r"(?::\d+)?" if port == "*" else ":" + port
    if host == "*":   # (scheme://*:* is scheme://*; scheme://*:PORT is no form of OLLAMA_ORIGINS)
        return None if hosts or port not in (None, "*") else re.escape(scheme) + r"://[^/?#@\s]+"
    if host.startswith("*."):
        domain = host[2:]
        if "*" in domain or not re.fullmatch(rf"{_LABEL}(?:\.{_LABEL})*", domain.lower()):
            return None
        host_rx = rf"(?i:(?:{_LABEL}\.)+{re.escape(domain)})"
    elif "*" in host:
        return None
    else:
        host_rx = f"(?i:{re.escape(host)})"
    if hosts:
        return host_rx + r"(?::\d+)?" if scheme in ("http", "https") and host.startswith("*.") else None
    return re.escape(scheme) + "://" + host_rx + port_rx


def wildcard_regex(origins, hosts: bool = False) -> re.Pattern | None:
    """The compiled alternation of the --cors-origin patterns among `origins` (those with a `*`, but `*` alone),
    None when there are none; hosts: of the Host headers they name (_pattern_regex)."""
    parts = [_pattern_regex(o.rstrip("/"), hosts) for o in origins if "*" in o and o != "*"]
    parts = [f"(?:{p})" for p in parts if p is not None]
    return re.compile("|".join(parts)) if parts else None


def origin_allowed(origin: str, origins=()) -> bool:
    """Whether a page of `origin` may call a server started with these --cors-origin values (this machine's own
    pages always may)."""
    origin = bare_origin(origin)
    wild = wildcard_regex(origins)
    return bool("*" in origins or re.fullmatch(LOCAL_ORIGINS, origin) or origin in origins
                or (wild is not None and wild.fullmatch(origin)))
