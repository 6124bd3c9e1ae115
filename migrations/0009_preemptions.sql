-- Every preemption of a running sequence by the engine's scheduler (issue 37), one row per
-- run.preempted event: why (`interactive_waiting`: a batch sequence gave way to interactive work;
-- `kv_cache_full`: a running sequence found no KV block), the request's service class, and the
-- generated tokens it kept (recomputed, with its prompt, when it runs again). The recorder and the
-- reader get their grants from 0007's default privileges; the gateway reads nothing here.
CREATE TABLE preemptions (
    event_id      text PRIMARY KEY,
    ts            timestamptz NOT NULL,
    request_id    text NOT NULL,
    model         text NOT NULL,
    node          text NOT NULL,
    reason        text NOT NULL,
    service_class text NOT NULL,
    tokens_kept   integer NOT NULL
);

CREATE INDEX preemptions_request_id_idx ON preemptions (request_id);
CREATE INDEX preemptions_model_ts_idx ON preemptions (model, ts);
