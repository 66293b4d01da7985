-- Group commit: the transitions of several sagas in one statement and one commit.
-- saga.write_sagas_v1 takes a JSON array of saga.write_saga_v4 arguments and applies each
-- in a subtransaction of its own, so that what one saga's write raises (a lost fence,
-- SG001; a refused confirmation, SG002; any other error) rolls back that write alone and
-- never the others'. It returns one object per write, in order: {"state": ...} as
-- saga.write_saga_v4 returns it, or {"sqlstate": ..., "message": ...} for a write that
-- was refused. Every write in the array shares the statement's commit: none is durable
-- before it, all are after it.
--
-- Compatibility (README, "Upgrades"): a new function; nothing the previous release calls
-- changes.

CREATE FUNCTION saga.write_sagas_v1(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_out   jsonb := '[]'::jsonb;
    v_write jsonb;
BEGIN
    FOR v_write IN SELECT value FROM jsonb_array_elements(p) WITH ORDINALITY ORDER BY ordinality
    LOOP
        BEGIN
            v_out := v_out || jsonb_build_array(
                jsonb_build_object('state', saga.write_saga_v4(v_write)));
        EXCEPTION WHEN OTHERS THEN
            v_out := v_out || jsonb_build_array(
                jsonb_build_object('sqlstate', SQLSTATE, 'message', SQLERRM));
        END;
    END LOOP;
    RETURN v_out;
END
$$;
