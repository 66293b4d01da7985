"""The named SQL of the package: files under saga/sql, read once at import."""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString, cast

_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def load_queries(file: str = "queries.sql") -> dict[str, LiteralString]:
    """Named queries of a file under saga/sql: each `-- name --` header, a description
    comment, then the SQL."""
    text = (resources.files("saga") / "sql" / file).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        # The file is part of the package, never user input: it is a literal in spirit.
        queries[name] = cast(LiteralString, body.strip())
    return queries
