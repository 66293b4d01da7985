"""The control loop, written once as generators of effects; no psycopg, threads or asyncio."""
