-- Admission decisions, node status history and bench results projected from EVENTS, plus the views
-- operators query. Every projection is derived from `events` alone, so `helexa recorder --rebuild`
-- can recompute it; nothing in a projection depends on when it was written.

-- Where in the EVENTS stream the recorded copy of an event was (NULL for events recorded before 0002).
ALTER TABLE events ADD COLUMN stream_seq bigint;

-- The time of the latest event merged into the row, not the wall time of the write, so a rebuild
-- reproduces it.
ALTER TABLE runs RENAME COLUMN updated_at TO last_event_at;
ALTER TABLE runs ALTER COLUMN last_event_at DROP DEFAULT;

-- One row per admission decision (event `admission`).
CREATE TABLE admission_events (
    event_id      text PRIMARY KEY,
    ts            timestamptz NOT NULL,
    model         text NOT NULL,
    node          text NOT NULL,
    request_id    text NOT NULL,
    principal     text,
    decision      text NOT NULL CHECK (decision IN (
                      'admitted', 'queue_full', 'principal_cap', 'timeout', 'context_exceeded', 'cancelled')),
    detail        text,
    pending       integer NOT NULL,
    in_flight     integer NOT NULL,
    retry_after_s double precision,
    waited_ms     double precision NOT NULL
);

CREATE INDEX admission_events_ts_idx ON admission_events (ts);
CREATE INDEX admission_events_model_ts_idx ON admission_events (model, ts);
CREATE INDEX admission_events_principal_ts_idx ON admission_events (principal, ts);
CREATE INDEX admission_events_request_id_idx ON admission_events (request_id);

-- Status history of every worker node (event `node.status`), one row per change.
CREATE TABLE nodes (
    event_id   text PRIMARY KEY,
    ts         timestamptz NOT NULL,
    node       text NOT NULL,
    model      text NOT NULL,
    status     text NOT NULL,
    version    text NOT NULL,
    models     text[] NOT NULL,
    slots      integer NOT NULL,
    free_slots integer NOT NULL,
    kv_usage   double precision
);

CREATE INDEX nodes_node_ts_idx ON nodes (node, ts);
CREATE INDEX nodes_model_ts_idx ON nodes (model, ts);
CREATE INDEX nodes_ts_idx ON nodes (ts);

-- One row per bench measurement (event `bench.run`); a re-published run replaces the older copy
-- (later ts wins, then the larger event_id), whatever order they arrive in.
CREATE TABLE bench_runs (
    run_id      text PRIMARY KEY,
    event_id    text NOT NULL,
    ts          timestamptz NOT NULL,
    model       text NOT NULL,
    node        text NOT NULL,
    target      text NOT NULL,
    scenario    text NOT NULL,
    config      jsonb NOT NULL,
    results     jsonb NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL
);

CREATE INDEX bench_runs_model_scenario_finished_at_idx ON bench_runs (model, scenario, finished_at);
CREATE INDEX bench_runs_finished_at_idx ON bench_runs (finished_at);

-- Numbers attached to bench runs (event `bench.score`): metrics the bench measured and quality
-- scores given later. Append-only; a run may arrive after its scores, so there is no foreign key.
CREATE TABLE scores (
    event_id text PRIMARY KEY,
    ts       timestamptz NOT NULL,
    run_id   text NOT NULL,
    model    text NOT NULL,
    node     text NOT NULL,
    scenario text NOT NULL,
    metric   text NOT NULL,
    value    double precision NOT NULL,
    unit     text,
    scorer   text NOT NULL
);

CREATE INDEX scores_run_id_metric_idx ON scores (run_id, metric);
CREATE INDEX scores_model_scenario_ts_idx ON scores (model, scenario, ts);

-- Latency of successful runs per model and hour (hours in the session's TimeZone).
-- percentile_disc is the nearest-rank percentile the bench uses: the smallest recorded value with
-- at least that fraction of runs at or below it, always a value that occurred.
CREATE VIEW run_latency_hourly AS
SELECT model,
       date_trunc('hour', finished_at) AS hour,
       count(*) AS runs,
       percentile_disc(0.50) WITHIN GROUP (ORDER BY ttft_ms) AS ttft_p50_ms,
       percentile_disc(0.95) WITHIN GROUP (ORDER BY ttft_ms) AS ttft_p95_ms,
       percentile_disc(0.99) WITHIN GROUP (ORDER BY ttft_ms) AS ttft_p99_ms,
       percentile_disc(0.50) WITHIN GROUP (ORDER BY e2e_ms) AS e2e_p50_ms,
       percentile_disc(0.95) WITHIN GROUP (ORDER BY e2e_ms) AS e2e_p95_ms,
       percentile_disc(0.99) WITHIN GROUP (ORDER BY e2e_ms) AS e2e_p99_ms
FROM runs
WHERE status = 'ok' AND finished_at IS NOT NULL
GROUP BY model, date_trunc('hour', finished_at);

-- Token throughput of successful runs per model and hour. Prefill rate counts the prompt tokens
-- not served from the prefix cache; decode rate counts the tokens after the first (which ends
-- prefill) over decode time.
CREATE VIEW run_throughput_hourly AS
SELECT model,
       date_trunc('hour', finished_at) AS hour,
       count(*) AS runs,
       sum(prompt_tokens) AS prompt_tokens,
       sum(cached_tokens) AS cached_tokens,
       sum(completion_tokens) AS completion_tokens,
       sum(prompt_tokens - cached_tokens) / nullif(sum(prefill_ms) / 1000.0, 0) AS prefill_tok_per_s,
       sum(greatest(completion_tokens - 1, 0)) / nullif(sum(decode_ms) / 1000.0, 0) AS decode_tok_per_s
FROM runs
WHERE status = 'ok' AND finished_at IS NOT NULL
GROUP BY model, date_trunc('hour', finished_at);

-- Admission decisions per model, principal (NULL = anonymous) and decision per hour, with the share
-- of that principal's decisions in the hour: the rejection rate by reason is `share` where
-- decision <> 'admitted'.
CREATE VIEW admission_hourly AS
SELECT date_trunc('hour', ts) AS hour,
       model,
       principal,
       decision,
       count(*) AS decisions,
       (sum(count(*)) OVER w)::bigint AS principal_decisions,
       (count(*) / sum(count(*)) OVER w)::double precision AS share,
       percentile_disc(0.95) WITHIN GROUP (ORDER BY waited_ms) AS waited_p95_ms
FROM admission_events
GROUP BY date_trunc('hour', ts), model, principal, decision
WINDOW w AS (PARTITION BY date_trunc('hour', ts), model, principal);

-- The latest bench run per target, model and scenario, one row per metric and scorer (each the
-- latest score given), or one row with NULL metric when nothing was scored.
CREATE VIEW bench_latest AS
WITH latest AS (
    SELECT DISTINCT ON (target, model, scenario) *
    FROM bench_runs
    ORDER BY target, model, scenario, finished_at DESC, run_id DESC
), latest_scores AS (
    SELECT DISTINCT ON (run_id, metric, scorer) *
    FROM scores
    ORDER BY run_id, metric, scorer, ts DESC, event_id DESC
)
SELECT l.target, l.model, l.scenario, l.run_id, l.started_at, l.finished_at,
       s.metric, s.value, s.unit, s.scorer, l.results
FROM latest l
LEFT JOIN latest_scores s ON s.run_id = l.run_id;

-- Each node's latest recorded status.
CREATE VIEW node_latest AS
SELECT DISTINCT ON (node) node, ts, model, status, version, models, slots, free_slots, kv_usage
FROM nodes
ORDER BY node, ts DESC, event_id DESC;

-- Retention (helexa_prune) is defined once, in migrations/functions/helexa_prune.sql.
