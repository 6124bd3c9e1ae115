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

-- Retention (helexa_prune) is defined once, in migrations/functions/helexa_prune.sql.
