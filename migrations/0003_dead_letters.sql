-- Events the recorder could not record: undecodable messages, and events PostgreSQL refused
-- (a value it rejects, an index row too large, ...). Each is kept here, with the error and its
-- place in the EVENTS stream, instead of stopping the recorder or being dropped; the events behind
-- it go on being recorded. Not a projection: `--rebuild` leaves it alone (and a replay that meets
-- the same message again adds no second row).
CREATE TABLE dead_letters (
    id             bigserial PRIMARY KEY,
    stream_seq     bigint,
    subject        text NOT NULL,
    -- As far as the message could be read: NULL when it did not decode.
    event_id       text,
    kind           text,
    reason         text NOT NULL CHECK (reason IN ('undecodable', 'rejected')),
    -- PostgreSQL's SQLSTATE for a rejected event (e.g. 54000 program_limit_exceeded), else NULL.
    sqlstate       text,
    error          text NOT NULL,
    -- The message body exactly as it was on the stream (bytea: it may hold what text cannot).
    payload        bytea NOT NULL,
    payload_sha256 bytea NOT NULL,
    failed_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream_seq, payload_sha256)
);

CREATE INDEX dead_letters_failed_at_idx ON dead_letters (failed_at);
