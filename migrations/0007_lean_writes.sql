-- Cheaper step transitions. Every step transition updates the saga row and one or two
-- operation rows and appends two or three audit events, so what each of those costs the
-- server is paid several times per saga.
--
-- Audit events: no foreign key. Its check ran once per appended event (a locking read of
-- the saga row, which the same statement has just updated). Events are only ever appended
-- by the statements that write their saga, and the purge deletes them with the saga.
-- Their primary key becomes (saga_id, id), the order history is read in, so an append
-- maintains one index instead of two.

ALTER TABLE saga.events DROP CONSTRAINT events_saga_id_fkey;
ALTER TABLE saga.events DROP CONSTRAINT events_pkey;
ALTER TABLE saga.events ADD CONSTRAINT events_pkey PRIMARY KEY (saga_id, id);
DROP INDEX saga.events_saga;

-- Room in each page for the updated versions of its rows, so that a transition that leaves
-- the indexed columns alone is a HOT update (no new index entries). Applies to pages
-- written from now on.
ALTER TABLE saga.sagas SET (fillfactor = 70);
ALTER TABLE saga.operations SET (fillfactor = 70);
