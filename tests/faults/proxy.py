"""A TCP proxy in front of PostgreSQL that loses replies after their commit landed.

The fault it makes is the one a network blip, a proxy restart or a failover makes: the
client sends a write, PostgreSQL commits it, and the connection drops before the reply
arrives. The client then cannot tell from the error whether its write happened.

The proxy speaks just enough of the PostgreSQL wire protocol to see statements go by:
it refuses TLS (the client falls back to plain text, as `sslmode=prefer` does), follows
Parse/Bind/Query messages (prepared statements included, by name) and the server's
ReadyForQuery status. A `Rule` picks statements by their SQL text and by bytes of their
parameters (an event name in a saga write, say). Once a statement matches, the proxy
lets its transaction finish on the server and then closes both sockets before the client
reads the reply that says so: for a statement outside a transaction, its whole reply is
lost; inside one, the replies up to the COMMIT's are delivered and the COMMIT's is lost.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from psycopg.conninfo import conninfo_to_dict, make_conninfo

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
# A rule that matched but whose transaction never ends closes the connection after this.
_ARMED_TIMEOUT_SECONDS = 10.0


@dataclass
class Rule:
    """Which statements lose their reply: SQL text containing `statement` whose
    parameters contain every one of `containing`; `times` of them (None: any number),
    each with `probability`."""

    statement: str
    containing: tuple[bytes, ...] = ()
    times: int | None = 1
    probability: float = 1.0
    matched: int = 0

    def wants(self, text: str, params: bytes, rng: random.Random) -> bool:
        if self.times is not None and self.matched >= self.times:
            return False
        if self.statement not in text or not all(c in params for c in self.containing):
            return False
        return self.probability >= 1.0 or rng.random() < self.probability


@dataclass(frozen=True)
class LostReply:
    """A reply the proxy lost: the statement's first line and whether the server
    reported an error for its transaction (False: it committed)."""

    statement: str
    failed: bool


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket
    statements: dict[bytes, str] = field(default_factory=dict)
    status: bytes = b"I"  # the server's last ReadyForQuery status
    armed: LostReply | None = None
    armed_at: float = 0.0
    swallowing: bool = False
    error: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class LostReplyProxy:
    """Forwards connections from a port of 127.0.0.1 to the PostgreSQL of `upstream_url`."""

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        self._upstream = upstream_address(upstream_url)
        self._upstream_url = upstream_url
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._links: list[_Link] = []
        self.lost: list[LostReply] = []
        self._seen: list[str] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="lost-reply-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The upstream URL, pointed at the proxy."""
        return make_conninfo(self._upstream_url, host="127.0.0.1", port=str(self.port))

    def lose_reply(
        self,
        statement: str,
        *containing: bytes | str,
        times: int | None = 1,
        probability: float = 1.0,
    ) -> Rule:
        """Lose the reply of the next `times` statements matching (see `Rule`)."""
        rule = Rule(
            statement,
            tuple(c.encode() if isinstance(c, str) else c for c in containing),
            times,
            probability,
        )
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Forget every rule (replies already being lost are lost all the same)."""
        with self._lock:
            self._rules.clear()

    def statements(self) -> list[str]:
        """Every statement executed through the proxy so far, in the order the clients
        sent them (each as `_sql_of` writes it); BEGIN and COMMIT included."""
        with self._lock:
            return list(self._seen)

    def lost_replies(self, statement: str = "") -> list[LostReply]:
        """Replies lost so far, of statements containing `statement`."""
        with self._lock:
            return [r for r in self.lost if statement in r.statement]

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            self._close(link)
        self._thread.join(timeout=5)

    def __enter__(self) -> LostReplyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- plumbing ------------------------------------------------------------------

    def _accept(self) -> None:
        # accept() is not woken by close() from another thread: look at _stopped often.
        self._listener.settimeout(0.2)
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            threading.Thread(
                target=self._serve, args=(client,), name="lost-reply-link", daemon=True
            ).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = connect_upstream(self._upstream)
        except OSError:
            client.close()
            return
        link = _Link(client, server)
        with self._lock:
            self._links.append(link)
        try:
            if not self._startup(link):
                return
            back = threading.Thread(
                target=self._pump_back, args=(link,), name="lost-reply-back", daemon=True
            )
            back.start()
            self._pump_forward(link)
            # The client is gone (it closed, or its process died): close the server side
            # too, as the kernel would for a direct connection, so that its backend ends
            # and rolls back. Left open, a transaction of a killed client stayed idle on
            # the server with its locks for as long as the proxy ran.
            self._close(link)
            back.join()
        except OSError:
            pass
        finally:
            self._close(link)
            with self._lock:
                self._links.remove(link)

    def _startup(self, link: _Link) -> bool:
        """Refuse TLS and GSS encryption, then pass the startup message on."""
        while True:
            head = _read_exact(link.client, 8)
            if head is None:
                return False
            length, code = struct.unpack("!ii", head)
            rest = _read_exact(link.client, length - 8)
            if rest is None:
                return False
            if code in (_SSL_REQUEST, _GSS_REQUEST):
                link.client.sendall(b"N")
                continue
            link.server.sendall(head + rest)
            return code != _CANCEL_REQUEST

    def _pump_forward(self, link: _Link) -> None:
        for kind, payload in _messages(link.client):
            text, params = self._statement(link, kind, payload)
            if text is not None:
                self._maybe_arm(link, text, params)
            link.server.sendall(kind + struct.pack("!i", len(payload) + 4) + payload)

    def _statement(self, link: _Link, kind: bytes, payload: bytes) -> tuple[str | None, bytes]:
        if kind == b"P":
            name, rest = _cstring(payload)
            query, _ = _cstring(rest)
            link.statements[name] = query.decode(errors="replace")
            return None, b""
        if kind == b"B":
            _, rest = _cstring(payload)
            name, params = _cstring(rest)
            return link.statements.get(name, ""), params
        if kind == b"Q":
            query, _ = _cstring(payload)
            return query.decode(errors="replace"), b""
        return None, b""

    def _maybe_arm(self, link: _Link, text: str, params: bytes) -> None:
        with self._lock:
            self._seen.append(_sql_of(text))
            if link.armed is not None:
                return
            rule = next((r for r in self._rules if r.wants(text, params, self._rng)), None)
            if rule is None:
                return
            rule.matched += 1
        with link.lock:
            link.armed = LostReply(_sql_of(text), failed=False)
            link.armed_at = time.monotonic()
            # Outside a transaction the statement's own reply is what says it committed.
            link.swallowing = link.status == b"I"

    def _pump_back(self, link: _Link) -> None:
        try:
            self._forward_replies(link)
        except OSError:  # the client went away (killed, or closed by the proxy)
            pass
        finally:
            self._close(link)

    def _forward_replies(self, link: _Link) -> None:
        for kind, payload in _messages(link.server, timeout=0.5, link=link):
            if kind == b"":  # a timeout tick
                if link.armed is not None and (
                    time.monotonic() - link.armed_at > _ARMED_TIMEOUT_SECONDS
                ):
                    self._lose(link)
                    return
                continue
            with link.lock:
                armed = link.armed is not None
                if armed and kind == b"E":
                    link.error = True
                if armed and kind == b"C" and payload.startswith(b"COMMIT"):
                    link.swallowing = True
                ended = armed and kind == b"Z" and payload[:1] == b"I"
                swallow = link.swallowing
                if kind == b"Z":
                    link.status = payload[:1]
            if ended:
                self._lose(link)
                return
            if not swallow:
                link.client.sendall(kind + struct.pack("!i", len(payload) + 4) + payload)

    def _lose(self, link: _Link) -> None:
        with link.lock:
            armed = link.armed
        if armed is not None:
            with self._lock:
                self.lost.append(LostReply(armed.statement, failed=link.error))
        self._close(link)

    def _close(self, link: _Link) -> None:
        with link.lock:
            if link.closed:
                return
            link.closed = True
        for sock in (link.client, link.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


def upstream_address(url: str) -> str | tuple[str, int]:
    """Where the server of `url` listens: a Unix socket's path when its host is a directory
    (as for libpq: the embedded server), else (host, port)."""
    params = conninfo_to_dict(url)
    host = str(params.get("host") or "127.0.0.1")
    port = int(params.get("port") or 5432)
    return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)


def connect_upstream(upstream: str | tuple[str, int]) -> socket.socket:
    """A socket connected to `upstream` (see `upstream_address`)."""
    if isinstance(upstream, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(upstream)
        except OSError:
            sock.close()
            raise
        return sock
    sock = socket.create_connection(upstream, timeout=10)
    sock.settimeout(None)
    return sock


def _read_exact(sock: socket.socket, count: int) -> bytes | None:
    chunks: list[bytes] = []
    while count:
        try:
            chunk = sock.recv(count)
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _messages(
    sock: socket.socket, *, timeout: float | None = None, link: _Link | None = None
) -> Iterator[tuple[bytes, bytes]]:
    """Typed messages (type byte, payload) from `sock` until it closes; with `timeout`,
    (b"", b"") whenever nothing arrived for that long."""
    sock.settimeout(timeout)
    buffer = b""
    while True:
        while len(buffer) >= 5:
            (length,) = struct.unpack("!i", buffer[1:5])
            if len(buffer) < length + 1:
                break
            yield buffer[:1], buffer[5 : length + 1]
            buffer = buffer[length + 1 :]
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if link is not None and link.closed:
                return
            yield b"", b""
            continue
        except OSError:
            return
        if not chunk:
            return
        buffer += chunk


def _sql_of(text: str) -> str:
    """The statement without its leading comment lines, on one line."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("--"))


def _cstring(data: bytes) -> tuple[bytes, bytes]:
    end = data.index(b"\0")
    return data[:end], data[end + 1 :]


def lose_everywhere(proxy: LostReplyProxy, statements: Sequence[str], probability: float) -> None:
    """Lose replies of these statements at random, each with `probability`, forever."""
    for statement in statements:
        proxy.lose_reply(statement, times=None, probability=probability)
