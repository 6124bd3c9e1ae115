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

-- Retention (helexa_prune) is defined once, in migrations/functions/helexa_prune.sql.
