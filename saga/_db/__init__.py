"""The database layer: the only package that imports psycopg."""
