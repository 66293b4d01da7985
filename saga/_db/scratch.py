"""Throwaway databases: a fresh, empty database on a server, dropped once used (the
testing kit's `postgres_url`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from saga._db.sqlfiles import load_queries

_SQL = load_queries("connections.sql")


@contextlib.contextmanager
def throwaway_database(server_url: str, name: str) -> Iterator[str]:
    """The URL of a fresh, empty database named `name`, made on the server whose
    maintenance URL is `server_url`; dropped when the block ends, its connections ended."""
    _run(server_url, "create_database", name)
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        _run(server_url, "drop_database", name)


def _run(server_url: str, query: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL(_SQL[query]).format(name=sql.Identifier(name)))
