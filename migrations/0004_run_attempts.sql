-- Every attempt of a request, and `runs` following the attempt that served the client.
--
-- A request can run more than once: redelivered after its worker died, or taken over by a second
-- worker while the first was silent. `run_attempts` keeps one row per attempt. `runs` describes the
-- attempt whose run.finished says it served the client (`served_attempt`); until one does (or for
-- events from publishers that do not say), the latest attempt as before. Both are projected from
-- `events` alone, so live recording and `--rebuild` give the same rows. Run
-- `helexa recorder --rebuild` once after this migration to fill `run_attempts` for older events.

-- The attempt that served the client, when an event said so; NULL otherwise.
ALTER TABLE runs ADD COLUMN served_attempt integer;
-- The event this row's attempt columns come from (ties between events are settled by its id).
ALTER TABLE runs ADD COLUMN decided_by text;

CREATE TABLE run_attempts (
    request_id        text NOT NULL,
    attempt           integer NOT NULL,
    model             text NOT NULL,
    node              text NOT NULL,
    principal         text,
    api               text NOT NULL,
    status            text NOT NULL,
    finish_reason     text,
    prompt_tokens     integer,
    completion_tokens integer,
    cached_tokens     integer,
    reasoning_tokens  integer,
    queue_ms          double precision,
    ttft_ms           double precision,
    prefill_ms        double precision,
    decode_ms         double precision,
    e2e_ms            double precision,
    error             text,
    -- From the attempt's run.finished: TRUE it served the client, FALSE it lost, NULL not known.
    served            boolean,
    started_at        timestamptz,
    finished_at       timestamptz,
    last_event_at     timestamptz NOT NULL,
    decided_by        text NOT NULL,
    PRIMARY KEY (request_id, attempt)
);

CREATE INDEX run_attempts_model_finished_at_idx ON run_attempts (model, finished_at);
CREATE INDEX run_attempts_node_finished_at_idx ON run_attempts (node, finished_at);

-- Retention now covers run_attempts too (same signature, so CREATE OR REPLACE keeps callers working).
CREATE OR REPLACE FUNCTION helexa_prune(older_than interval)
RETURNS TABLE (table_name text, deleted bigint)
LANGUAGE plpgsql AS $$
DECLARE
    cutoff timestamptz := now() - older_than;
    n bigint;
BEGIN
    DELETE FROM events WHERE ts < cutoff;
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
END
$$;
