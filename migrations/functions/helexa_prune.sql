-- Retention for old rows: `SELECT * FROM helexa_prune(interval '90 days')` deletes raw events and
-- projection rows older than that and reports how many went from each table. Keep it longer than
-- the EVENTS stream's max_age, or a `--rebuild` replays the younger stream back in.
--
-- This file is the function's one definition: the migrator re-applies it whenever its text changes
-- (apps/recorder/migrate.py, `schema_functions`), so a migration that adds a table adds its line here.
-- What is kept whatever its age:
-- - files, and the events their rows are rebuilt from, until their owner deletes them;
-- - a batch still running, with its lines and events; one that ended before the cutoff goes with
--   its lines and events (its output and error files stay until their owner deletes them).
CREATE OR REPLACE FUNCTION helexa_prune(older_than interval)
RETURNS TABLE (table_name text, deleted bigint)
LANGUAGE plpgsql AS $$
DECLARE
    cutoff timestamptz := now() - older_than;
    n bigint;
    ended text[] := ARRAY(
        SELECT batch_id FROM batches
        WHERE status_rank = 4 AND to_timestamp(greatest(completed_at, failed_at, expired_at, cancelled_at)) < cutoff);
BEGIN
    DELETE FROM events WHERE ts < cutoff AND kind NOT IN ('file.created', 'file.deleted')
      AND (kind NOT LIKE 'batch.%' OR payload->>'batch_id' = ANY(ended));
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'events'; deleted := n; RETURN NEXT;
    DELETE FROM runs WHERE last_event_at < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'runs'; deleted := n; RETURN NEXT;
    DELETE FROM run_attempts WHERE last_event_at < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'run_attempts'; deleted := n; RETURN NEXT;
    DELETE FROM admission_events WHERE ts < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'admission_events'; deleted := n; RETURN NEXT;
    DELETE FROM nodes WHERE ts < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'nodes'; deleted := n; RETURN NEXT;
    DELETE FROM bench_runs WHERE finished_at < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'bench_runs'; deleted := n; RETURN NEXT;
    DELETE FROM scores WHERE ts < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'scores'; deleted := n; RETURN NEXT;
    DELETE FROM responses WHERE coalesce(ts, deleted_at) < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'responses'; deleted := n; RETURN NEXT;
    DELETE FROM preemptions WHERE ts < cutoff;
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'preemptions'; deleted := n; RETURN NEXT;
    DELETE FROM batch_lines WHERE batch_id = ANY(ended);
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'batch_lines'; deleted := n; RETURN NEXT;
    DELETE FROM batches WHERE batch_id = ANY(ended);
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'batches'; deleted := n; RETURN NEXT;
END
$$;
