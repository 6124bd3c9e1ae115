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
    ended text[] := ARRAY(
        SELECT batch_id FROM batches
        WHERE status_rank = 4 AND to_timestamp(greatest(completed_at, failed_at, expired_at, cancelled_at)) < cutoff);
    -- Each table and the rows it loses, in this order: $1 is the cutoff, $2 the batches that ended before it.
    rules text[] := ARRAY[
        ['events', $r$ts < $1 AND kind NOT IN ('file.created', 'file.deleted')
                      AND (kind NOT LIKE 'batch.%' OR payload->>'batch_id' = ANY($2))$r$],
        ['runs', 'last_event_at < $1'], ['run_attempts', 'last_event_at < $1'],
        ['admission_events', 'ts < $1'], ['nodes', 'ts < $1'], ['bench_runs', 'finished_at < $1'],
        ['scores', 'ts < $1'], ['responses', 'coalesce(ts, deleted_at) < $1'], ['preemptions', 'ts < $1'],
        ['batch_lines', 'batch_id = ANY($2)'], ['batches', 'batch_id = ANY($2)']];
    rule text[];
BEGIN
    FOREACH rule SLICE 1 IN ARRAY rules LOOP
        EXECUTE format('DELETE FROM %I WHERE %s', rule[1], rule[2]) USING cutoff, ended;
        GET DIAGNOSTICS deleted = ROW_COUNT;
        table_name := rule[1];
        RETURN NEXT;
    END LOOP;
END
$$;
