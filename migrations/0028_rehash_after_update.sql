-- The request hash version of a changed request_hash (migration 0023) is kept by an AFTER
-- trigger instead of a BEFORE trigger.
--
-- Migration 0023's BEFORE UPDATE OF request_hash trigger set hash_version from the
-- transaction's `saga.hash_version` (1 when unset) on every row whose request_hash
-- changed. Its WHEN clause kept the function from running on most rows, but a row-level
-- BEFORE UPDATE trigger costs every UPDATE of saga.operations, whatever its columns and
-- whatever the WHEN clause says: the executor locks each row it is about to update
-- (heap_lock_tuple, one more WAL record a row) to hand the trigger its current version,
-- before it looks at which triggers apply. A saga of three steps has its operation rows
-- updated six times (the claim's start of the first attempt among them, which does not
-- touch request_hash), each paying that lock.
--
-- This trigger applies the same rule after the row is written: when request_hash changed,
-- its function sets hash_version to the transaction's version (1 when unset) unless the
-- row has it already (a second update of the row, in the same statement). An AFTER row
-- trigger locks nothing; saga.operations already has one (its foreign key's check), so the
-- old row is read for it anyway, and the WHEN clause is 0023's, evaluated on the rows of
-- the statements that name request_hash as before. A row hashed again by the release that
-- wrote it keeps its version and is not updated again; only a release rehashing a row
-- another one wrote (during a rolling upgrade), or a statement setting the version
-- against the rule, costs the second update. The function runs where 0023's did: on rows
-- whose request_hash changes (none in a run of the benchmark's sagas of three steps).
--
-- What a row ends with is what the BEFORE trigger left: whoever changes request_hash (a
-- write function of this or of an older release, in any version, or a plain UPDATE) leaves
-- the version of the transaction that changed it. A statement's own RETURNING sees the
-- row before the correction; every later statement, and the state the write functions
-- read back after their UPDATE, sees it after.
--
-- Compatibility (README, "Upgrades"): no function the previous release calls changes;
-- saga.rehashed_version, the old trigger's function, is dropped with it (nothing else
-- calls it).

CREATE FUNCTION saga.rehashed_version_v2() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_version smallint :=
        COALESCE(NULLIF(current_setting('saga.hash_version', true), '')::smallint, 1);
BEGIN
    IF NEW.hash_version IS DISTINCT FROM v_version THEN
        UPDATE saga.operations
        SET hash_version = v_version
        WHERE saga_id = NEW.saga_id AND kind = NEW.kind AND step = NEW.step;
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS operations_rehashed ON saga.operations;
DROP FUNCTION IF EXISTS saga.rehashed_version();

CREATE TRIGGER operations_rehashed
    AFTER UPDATE OF request_hash ON saga.operations
    FOR EACH ROW
    WHEN (OLD.request_hash IS DISTINCT FROM NEW.request_hash)
    EXECUTE FUNCTION saga.rehashed_version_v2();
