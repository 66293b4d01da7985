"""Passwords out of every message: database URLs and error texts scrubbed without trusting
that the URL parses.

A URL that does not parse (no scheme, a `/` or `@` left unescaped in its password) is
exactly the one whose pieces a driver error quotes back, so nothing here relies on the
parse: everything between `://` (or the start) and the last `@` is a credential, and so is
any `password=` value, quoted or not.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"

# `password=VALUE` (conninfo keyword or URL query parameter): quoted with '...' (backslash
# escapes, possibly unterminated) or bare up to whitespace (or `&`, in a URL's query).
_PASSWORD_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*(?:'|$)|[^\s&]*)", re.IGNORECASE)
# In key=value conninfo, what the writer may have meant as the password: up to the next
# `keyword=` (a space left unquoted in the value), `&` included.
_BARE_VALUE = re.compile(r"password\s*=\s*(.*?)(?=\s+[A-Za-z_]+\s*=|$)", re.IGNORECASE)
# `scheme://userinfo@` anywhere in a text: the userinfo up to the last `@` of that word.
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@")
# Where a driver may cut a malformed URL into pieces (host, port, dbname...).
_PIECES = re.compile(r"""[\s/?#@:\[\],&='"%\\]+""")
# Secrets shorter than this are removed only where they stand alone, not inside words.
_SHORT = 4


def redact(text: str) -> str:
    """`text` with any `password=` value and any URL userinfo replaced by `***`."""
    text = _PASSWORD_KV.sub(lambda m: m.group(1) + MASK, text)
    return _URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)


def _credential_span(url: str) -> str:
    """What lies between `://` (or the start) and the last `@`; empty without an `@`."""
    start = url.find("://")
    start = 0 if start < 0 else start + 3
    end = url.rfind("@")
    return url[start:end] if end >= start else ""


def redact_url(url: str) -> str:
    """A form of `url` fit to show: credentials before the last `@` and `password=` values
    replaced by `***`, whether or not the URL parses."""
    shown = url
    start = url.find("://")
    start = 0 if start < 0 else start + 3
    if url.rfind("@") >= start:
        shown = url[:start] + MASK + url[url.rfind("@") :]
    return redact(_remove_secrets(shown, url))


def url_secrets(url: str) -> list[str]:
    """Every string of `url` that may be (part of) its password, longest first."""
    passwords: set[str] = set()
    found: set[str] = set()
    span = _credential_span(url)
    if ":" in span:
        found.add(span)
        passwords.add(span.split(":", 1)[1])
    for match in _PASSWORD_KV.finditer(url):
        value = match.group(2)
        if value.startswith("'"):
            value = value[1:-1] if value.endswith("'") and len(value) > 1 else value[1:]
            passwords.add(re.sub(r"\\(.)", r"\1", value))
        passwords.add(value)
    if "://" not in url:
        passwords.update(m.group(1) for m in _BARE_VALUE.finditer(url))
    try:
        from psycopg.conninfo import conninfo_to_dict

        parsed = conninfo_to_dict(url).get("password")
    except Exception:
        parsed = None
    if parsed:
        passwords.add(str(parsed))
    passwords.update([unquote(p) for p in passwords])
    found.update(passwords)
    for password in passwords:
        found.update(_PIECES.split(password))
    found.discard("")
    return sorted(found, key=lambda s: (-len(s), s))


def _remove_secrets(text: str, url: str) -> str:
    for secret in url_secrets(url):
        if len(secret) >= _SHORT:
            text = text.replace(secret, MASK)
        else:
            bounded = rf"(?<![\w.-]){re.escape(secret)}(?![\w.-])"
            text = re.sub(bounded, MASK, text)
    return text


def scrub(text: str, *urls: str | None) -> str:
    """`text` without any password of `urls` (the raw URLs shown redacted) and without any
    `password=` value or URL userinfo of its own."""
    for url in urls:
        if url:
            text = _remove_secrets(text.replace(url, redact_url(url)), url)
    return redact(text)
