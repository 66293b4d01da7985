"""A client of the embedded PostgreSQL in `SAGA_EMBEDDED_DIR`, run as a child process.

It attaches to the server (starting it if need be), runs one query, prints `READY` and
the server's URL, then waits for a line on stdin and exits normally, or is killed first.
"""

from __future__ import annotations

import sys

import psycopg

from saga._db.database import embedded_database_url


def main() -> int:
    url = embedded_database_url()
    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1")
    print(f"READY {url}", flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
