-- Batches (/v1/batches), projected from batch.created, batch.status and batch.line events.
--
-- `batches`: one row per batch, its columns from its batch.created; its status is the furthest one
-- its batch.status events reached in OpenAI's order (`status_rank`: validating 0, in_progress 1,
-- cancelling 2, finalizing 3, completed / failed / expired / cancelled 4), each status's time the
-- first one reported. A row may exist with only statuses known (batch.created still to come).
CREATE TABLE batches (
    batch_id          text PRIMARY KEY,
    event_id          text,
    principal         text,
    input_file_id     text,
    endpoint          text,
    completion_window text,
    metadata          jsonb,
    -- Unix seconds, as the Batch object has them.
    created_at        bigint,
    expires_at        bigint,
    status            text NOT NULL DEFAULT 'validating',
    status_rank       smallint NOT NULL DEFAULT 0,
    total             integer,
    output_file_id    text,
    error_file_id     text,
    errors            jsonb,
    in_progress_at    bigint,
    cancelling_at     bigint,
    finalizing_at     bigint,
    completed_at      bigint,
    failed_at         bigint,
    expired_at        bigint,
    cancelled_at      bigint
);

CREATE INDEX batches_principal_idx ON batches (principal, batch_id);

-- `batch_lines`: one row per finished line (answered, or an error line that never ran). A line
-- answered twice (a runner taken over after it died) is recorded once: by its line number, and
-- by its custom_id, which OpenAI requires unique within a batch.
CREATE TABLE batch_lines (
    batch_id    text NOT NULL,
    line        integer NOT NULL,
    custom_id   text,
    event_id    text NOT NULL,
    ts          timestamptz NOT NULL,
    status_code integer,
    request_id  text,
    body        jsonb,
    error       jsonb,
    PRIMARY KEY (batch_id, line),
    UNIQUE (batch_id, custom_id)
);

GRANT SELECT ON batches, batch_lines TO helexa_gateway;

-- Retention: a batch that ended before the cutoff goes with its lines (its output and error files
-- stay until their owner deletes them) and its events; a batch still running keeps its events,
-- whatever their age, since its rows are rebuilt from them (same signature as before).
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
    DELETE FROM batch_lines WHERE batch_id = ANY(ended);
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'batch_lines'; deleted := n; RETURN NEXT;
    DELETE FROM batches WHERE batch_id = ANY(ended);
    GET DIAGNOSTICS n = ROW_COUNT; table_name := 'batches'; deleted := n; RETURN NEXT;
END
$$;
