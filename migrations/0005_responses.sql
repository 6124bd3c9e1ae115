-- Stored Responses API answers (`store`), served back to `previous_response_id` and
-- GET /v1/responses/{id}, projected from response.stored and response.deleted events.
--
-- A row merges the two kinds in whatever order they arrive: the stored columns come from the
-- latest response.stored (by ts, event id), deleted_at from the earliest response.deleted. A row
-- may exist with only its deletion known (the columns of the stored event still NULL). Deleting
-- hides a response from its clients; the responses that follow it still rebuild their
-- conversation through it, and its events stay in `events` like every other.

CREATE TABLE responses (
    response_id          text PRIMARY KEY,
    -- The response.stored event the stored columns come from; NULL while only a deletion is known.
    event_id             text,
    ts                   timestamptz,
    model                text,
    principal            text,
    previous_response_id text,
    status               text,
    -- This request's own input items; the earlier turns are in previous_response_id's chain.
    input_items          jsonb,
    -- The response object as its client got it.
    response             jsonb,
    deleted_at           timestamptz,
    deleted_by           text
);

CREATE INDEX responses_principal_ts_idx ON responses (principal, ts);
CREATE INDEX responses_previous_idx ON responses (previous_response_id);

-- Retention (helexa_prune) is defined once, in migrations/functions/helexa_prune.sql.
