"""Least-privilege roles: what `saga grant` gives a role, and what a role lacks.

Three kinds, each with the privileges of the one before: `reader` (`saga list`, `saga
show`, the dashboard), `worker` (orchestrators and workers: start, claim and drive
sagas; no DDL) and `operator` (the `saga` command's verbs, `saga purge` included). The
migrations run as the owner of the saga schema, a role that needs no superuser right;
that owner grants the others (saga/sql/grants.sql says what each gets).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, LiteralString, get_args

import psycopg
from psycopg import sql

from saga._db.database import describe_url
from saga._db.sqlfiles import load_queries
from saga.errors import InsufficientPrivilege, SchemaMissing

RoleKind = Literal["reader", "worker", "operator"]
ROLE_KINDS: tuple[RoleKind, ...] = get_args(RoleKind)

_SQL = load_queries("grants.sql")
# The table privileges each kind needs, checked by `missing_privileges`.
_NEEDS: dict[RoleKind, tuple[list[str], bool]] = {
    "reader": (["SELECT"], False),
    "worker": (["SELECT", "INSERT", "UPDATE", "DELETE"], False),
    "operator": (["SELECT", "INSERT", "UPDATE", "DELETE"], True),
}


def role_kind(kind: str) -> RoleKind:
    """`kind` as a role kind; ValueError naming the kinds when it is none of them."""
    if kind not in ROLE_KINDS:
        raise ValueError(f"unknown role kind {kind!r}: one of {', '.join(ROLE_KINDS)}")
    return kind


def grant(conn: psycopg.Connection[Any], kind: RoleKind, role: str) -> None:
    """Give `role` the privileges of `kind` on the saga schema, now and for what later
    migrations create, in one transaction; run as the schema's owner.

    Raises ValueError when `role` does not exist (nothing is granted then)."""
    with conn.transaction():
        found = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        if found is None:
            raise ValueError(f"role {role!r} does not exist: a DBA makes it first, as a login role")
        for section in ROLE_KINDS[: ROLE_KINDS.index(kind) + 1]:
            conn.execute(sql.SQL(_SQL[section]).format(role=sql.Identifier(role)))


def grant_role(url: str, kind: RoleKind, role: str) -> None:
    """Connect to `url` (as the saga schema's owner) and `grant` there; what PostgreSQL
    refuses is raised as the orchestrator's error: `InsufficientPrivilege` for a role
    that may not grant, `SchemaMissing` before the migrations ran."""
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            grant(conn, kind, role)
        except psycopg.errors.InsufficientPrivilege as exc:
            said = exc.diag.message_primary or str(exc)
            raise InsufficientPrivilege(
                f"role {conn.info.user!r} may not grant privileges on the saga schema "
                f"({said}): run `saga grant` as its owner",
                sqlstate=exc.sqlstate,
            ) from None
        except psycopg.errors.InvalidSchemaName:
            raise SchemaMissing(
                "the saga schema is missing from the database: run `saga migrate` first"
            ) from None


def privileges_query(kind: RoleKind) -> tuple[LiteralString, dict[str, Any]]:
    """The query of what the connected role lacks of the privileges of `kind`, and its
    parameters: rows of `role` and `missing` ("UPDATE on saga.sagas", ...), none when it
    has them all."""
    privileges, delete_all = _NEEDS[kind]
    return _SQL["missing_privileges"], {"privileges": privileges, "delete_all": delete_all}


def check_privileges(rows: Sequence[dict[str, Any]], kind: RoleKind, conninfo: str) -> None:
    """Raise `InsufficientPrivilege` when `rows` (of `privileges_query`) name privileges
    the role connected to `conninfo` lacks: the message says which, and the command that
    grants them."""
    if not rows:
        return
    where = describe_url(conninfo) if conninfo else "the configured database"
    role = str(rows[0]["role"])
    missing = [str(row["missing"]) for row in rows]
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    raise InsufficientPrivilege(
        f"role {role!r} cannot act as a saga {kind} on {where}: it lacks {shown}; the owner "
        f"of the saga schema grants them with `saga grant {kind} {role}`",
        sqlstate="42501",
    )
