-- Request hash versions (saga.keys.HASH_VERSIONS): every operation records the version
-- its request_hash was computed under, and every saga the version of its input_hash.
--   1  SHA-256 of Python's json.dumps with sorted keys (every row written before this
--      migration, and every row a release without it writes)
--   2  SHA-256 of RFC 8785 (JSON Canonicalization Scheme)
-- A release that computes version 2 says so in the transaction-local setting
-- `saga.hash_version`: each statement that writes operations or sagas passes its
-- argument through saga.hashed_under(version, value), which sets it before the write
-- function runs (function arguments are evaluated first), and its connections also set
-- it (a startup option on a direct connection, per transaction through a pooler). The
-- columns' default reads it, so the write functions stay as they are, and a release
-- that does not set it keeps writing rows marked 1, as it hashes them. A changed
-- request_hash (a new prepared request) takes the version of the release that wrote it.

ALTER TABLE saga.operations ADD COLUMN IF NOT EXISTS hash_version smallint NOT NULL DEFAULT 1;
ALTER TABLE saga.operations ALTER COLUMN hash_version
    SET DEFAULT COALESCE(NULLIF(current_setting('saga.hash_version', true), '')::smallint, 1);

ALTER TABLE saga.sagas ADD COLUMN IF NOT EXISTS hash_version smallint NOT NULL DEFAULT 1;
ALTER TABLE saga.sagas ALTER COLUMN hash_version
    SET DEFAULT COALESCE(NULLIF(current_setting('saga.hash_version', true), '')::smallint, 1);

CREATE OR REPLACE FUNCTION saga.hashed_under(p_version integer, p_value jsonb) RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('saga.hash_version', p_version::text, true);
    RETURN p_value;
END;
$$;

CREATE OR REPLACE FUNCTION saga.hashed_under(p_version integer, p_value text) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('saga.hash_version', p_version::text, true);
    RETURN p_value;
END;
$$;

CREATE OR REPLACE FUNCTION saga.rehashed_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.hash_version := COALESCE(NULLIF(current_setting('saga.hash_version', true), '')::smallint, 1);
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS operations_rehashed ON saga.operations;
CREATE TRIGGER operations_rehashed
    BEFORE UPDATE OF request_hash ON saga.operations
    FOR EACH ROW
    WHEN (OLD.request_hash IS DISTINCT FROM NEW.request_hash)
    EXECUTE FUNCTION saga.rehashed_version();
