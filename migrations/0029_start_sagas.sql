-- Group commit for starts: the starts that concurrent callers have ready while a start is
-- on the wire go out together, in one statement and one commit (as the workers' writes
-- do through saga.write_sagas_v2).
--
-- saga.start_sagas_v1(p) takes a JSON array of saga.start_saga_v3 arguments (migration
-- 0020) and applies each as saga.start_saga_v3 does, in the array's order, in one
-- transaction. It returns one object per start, in order: {"outcome": ...} as
-- saga.start_saga_v3 returns it ({"created": true, ...}, or {"created": false, "id",
-- "version", "input_hash"} of the saga that holds the start's (tenant, name, key)), or
-- {"sqlstate": ..., "message": ...} for a start that was refused (a row a constraint
-- rejects, say): that start alone is rolled back, the others commit. Every start in the
-- array shares the statement's commit: none is durable before it, all are after it; a
-- start's write token, events, operations and NOTIFY are what saga.start_saga_v3 writes.
--
-- Two starts of the same (tenant, name, key) in one array end as two concurrent single
-- starts do: the first creates the saga, the second finds it and answers created false
-- with the first one's id and input hash.
--
-- The starts are applied in the order of their (tenant, name, key), the array's order
-- among starts of the same key, so that two batches in flight at once (two processes,
-- say) that share keys wait for each other in one order and never deadlock; the answers
-- come back in the array's order.
--
-- The starts are first applied together in one subtransaction; only when one of them
-- raises is that rolled back and each start applied again in a subtransaction of its own,
-- so that what one start raises rolls back that start alone. A batch of starts that all
-- succeed pays for one subtransaction, not one a start.
--
-- Compatibility (README, "Upgrades"): a new function; nothing the previous release calls
-- changes.

CREATE FUNCTION saga.start_sagas_v1(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_out   jsonb[] := array_fill(NULL::jsonb, ARRAY[jsonb_array_length(p)]);
    v_start record;
BEGIN
    BEGIN
        FOR v_start IN
            SELECT value, ordinality FROM jsonb_array_elements(p) WITH ORDINALITY
            ORDER BY value->'row'->>'tenant_id', value->'row'->>'name', value->'row'->>'key',
                     ordinality
        LOOP
            v_out[v_start.ordinality] :=
                jsonb_build_object('outcome', saga.start_saga_v3(v_start.value));
        END LOOP;
        RETURN to_jsonb(v_out);
    EXCEPTION WHEN OTHERS THEN
        NULL;  -- One start raised: everything above is rolled back; each start again, alone.
    END;

    FOR v_start IN
        SELECT value, ordinality FROM jsonb_array_elements(p) WITH ORDINALITY
        ORDER BY value->'row'->>'tenant_id', value->'row'->>'name', value->'row'->>'key',
                 ordinality
    LOOP
        BEGIN
            v_out[v_start.ordinality] :=
                jsonb_build_object('outcome', saga.start_saga_v3(v_start.value));
        EXCEPTION WHEN OTHERS THEN
            v_out[v_start.ordinality] :=
                jsonb_build_object('sqlstate', SQLSTATE, 'message', SQLERRM);
        END;
    END LOOP;
    RETURN to_jsonb(v_out);
END
$$;
