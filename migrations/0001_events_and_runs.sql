-- The raw event ledger and the per-request projection built from it.

-- Every event exactly once, as published on EVENTS; append-only, so projections can be rebuilt from it.
CREATE TABLE events (
    event_id    text PRIMARY KEY,
    kind        text NOT NULL,
    subject     text NOT NULL,
    model       text NOT NULL,
    node        text NOT NULL,
    ts          timestamptz NOT NULL,
    payload     jsonb NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX events_ts_idx ON events (ts);
CREATE INDEX events_kind_ts_idx ON events (kind, ts);
CREATE INDEX events_model_ts_idx ON events (model, ts);

-- One row per request, merged from run.started and run.finished in whatever order they arrive.
-- Columns other than started_at describe the latest attempt; NULL means not known (yet).
CREATE TABLE runs (
    request_id        text PRIMARY KEY,
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
    attempt           integer NOT NULL,
    error             text,
    started_at        timestamptz,
    finished_at       timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX runs_started_at_idx ON runs (started_at);
CREATE INDEX runs_finished_at_idx ON runs (finished_at);
CREATE INDEX runs_model_started_at_idx ON runs (model, started_at);
CREATE INDEX runs_model_finished_at_idx ON runs (model, finished_at);
CREATE INDEX runs_principal_started_at_idx ON runs (principal, started_at);
