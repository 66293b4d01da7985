-- The statements of the connections the package opens apart from its pools: the one a
-- worker or the dashboard LISTENs on (saga/_db/listen_async.py), and the maintenance
-- connection that makes the testing kit's throwaway databases (saga/_db/scratch.py).
-- Identifiers ({channel}, {name}) go in through psycopg.sql.

-- listen --
-- Wake-ups: the orchestrator NOTIFYs this channel when a saga becomes runnable.
LISTEN {channel}

-- change_marker --
-- What moves with every transition of any saga (each appends an audit event, and takes
-- an id of this sequence): one read, the same cost however many sagas and events there are.
SELECT last_value, is_called FROM saga.events_id_seq

-- change_marker_fallback --
-- change_marker for a role that may not read the sequence: it scans the table (no index
-- has updated_at).
SELECT max(updated_at) FROM saga.sagas

-- create_database --
-- A fresh, empty database.
CREATE DATABASE {name}

-- drop_database --
-- A throwaway database, its connections ended.
DROP DATABASE IF EXISTS {name} WITH (FORCE)
