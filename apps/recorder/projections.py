"""What each event kind writes into the ledger's projections: SQL over a source table of events (the
staging table of a live batch, or `events` itself for a rebuild), used by `apps.recorder.projector`.

Every projection is one INSERT … SELECT over the events' JSON payloads. The same statements read
the staging table for a live batch and the whole `events` table for a rebuild, so a rebuild
recomputes exactly what live recording produced.

`run_attempts` merges run.started and run.finished per (request, attempt), and `runs` per request,
whatever order they arrive in. Each row is the maximum of its events under one order, so the
result does not depend on arrival order, batch boundaries or concurrent recorders:
- `runs`: an attempt that served the client (run.finished with `served`) beats any that did not,
  then the higher attempt, then run.finished beats run.started, then the larger event id;
- `run_attempts`: run.finished beats run.started, then the larger event id.
`started_at` is the earliest start seen and `last_event_at` the latest event. Events for one
request inside one batch are applied in rounds, one event per request per round, in (ts, event_id)
order.

`responses` merges response.stored (the latest wins) and response.deleted (the earliest wins) per
response id, in either order, so a deletion projected before its response still hides it. A
deleted response's content is erased, whichever came first: its row keeps ids, owner and dates
only, and its response.stored payloads in `events` lose their input items and response object.
Each stored or deleted response is announced on the `helexa_responses` channel (NOTIFY, delivered
at commit), so a gateway waiting for a response made elsewhere learns the moment it is readable.

`files` merges file.created (the first wins: one per id) and file.deleted (the earliest wins) per
file id, in either order; each is announced on `helexa_files` as responses are on theirs.

`batches` merges batch.created (one per id) and batch.status (the furthest status in OpenAI's order
wins, each status's earliest time is kept), announced on `helexa_batches`; `batch_lines` keeps the
first batch.line per line, one row per (batch, custom_id), so a line answered twice counts once.
"""

from __future__ import annotations

from apps.bus import events

# The NOTIFY channel of stored and deleted responses (payload: the response id).
RESPONSES_CHANNEL = "helexa_responses"
# The NOTIFY channel of created and deleted files (payload: the file id).
FILES_CHANNEL = "helexa_files"
# The NOTIFY channel of created batches and their status changes (payload: the batch id).
BATCHES_CHANNEL = "helexa_batches"

RUNNING = "running"
PROJECTIONS = ("runs", "run_attempts", "admission_events", "nodes", "bench_runs", "scores", "responses", "files",
               "preemptions", "batches", "batch_lines")

_STARTED = events.kind_of(events.RunStarted)
_FINISHED = events.kind_of(events.RunFinished)
_ADMISSION = events.kind_of(events.AdmissionDecided)
_NODE = events.kind_of(events.NodeStatusChanged)
_BENCH_RUN = events.kind_of(events.BenchRunRecorded)
_SCORE = events.kind_of(events.ScoreRecorded)
_PREEMPTED = events.kind_of(events.RunPreempted)
_RESPONSE_STORED = events.kind_of(events.ResponseStored)
_RESPONSE_DELETED = events.kind_of(events.ResponseDeleted)
_FILE_CREATED = events.kind_of(events.FileCreated)
_FILE_DELETED = events.kind_of(events.FileDeleted)
_BATCH_CREATED = events.kind_of(events.BatchCreated)
_BATCH_STATUS = events.kind_of(events.BatchStatus)
_BATCH_LINE = events.kind_of(events.BatchLine)

# Everything about a run except its identity, first start and latest event belongs to one attempt.
_OUTCOME_COLUMNS = (
    "model", "node", "principal", "api", "status", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
    "queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "e2e_ms", "error", "finished_at", "decided_by",
    "tensor_parallel",
)  # fmt: skip
_ATTEMPT_COLUMNS = (*_OUTCOME_COLUMNS, "attempt", "served_attempt")

# The candidate row of one event: columns run.started does not carry are NULL, so a retry starting
# clears the previous outcome.
_CANDIDATE = f"""
       p->>'request_id', model, node, p->>'principal', p->>'api',
       CASE WHEN kind = '{_STARTED}' THEN '{RUNNING}' ELSE p->>'status' END, p->>'finish_reason',
       (p->>'prompt_tokens')::integer, (p->>'completion_tokens')::integer,
       (p->>'cached_tokens')::integer, (p->>'reasoning_tokens')::integer,
       (p->>'queue_ms')::float8, (p->>'ttft_ms')::float8, (p->>'prefill_ms')::float8,
       (p->>'decode_ms')::float8, (p->>'e2e_ms')::float8, p->>'error',
       CASE WHEN kind = '{_STARTED}' THEN ts END, CASE WHEN kind = '{_FINISHED}' THEN ts END, ts, event_id,
       (p->>'attempt')::integer, (p->>'tensor_parallel')::integer"""
_CANDIDATE_COLUMNS = """
    request_id, model, node, principal, api, status, finish_reason,
    prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens,
    queue_ms, ttft_ms, prefill_ms, decode_ms, e2e_ms, error,
    started_at, finished_at, last_event_at, decided_by, attempt, tensor_parallel"""

# The orders of the module docstring, as row comparisons (a NULL decided_by predates migration 0004).
_RUNS_WINS = (
    "(EXCLUDED.served_attempt IS NOT NULL, EXCLUDED.attempt, EXCLUDED.finished_at IS NOT NULL, EXCLUDED.decided_by)"
    " > (r.served_attempt IS NOT NULL, r.attempt, r.finished_at IS NOT NULL, coalesce(r.decided_by, ''))"
)
_ATTEMPT_WINS = "(EXCLUDED.finished_at IS NOT NULL, EXCLUDED.decided_by) > (r.finished_at IS NOT NULL, r.decided_by)"


def _merge(columns: tuple[str, ...], wins: str) -> str:
    take = ",\n    ".join(f"{c} = CASE WHEN {wins} THEN EXCLUDED.{c} ELSE r.{c} END" for c in columns)
    return f"""{take},
    started_at = LEAST(r.started_at, EXCLUDED.started_at),
    last_event_at = GREATEST(r.last_event_at, EXCLUDED.last_event_at)"""


def _round(source: str, partition: str) -> str:
    """This round's run events of `source`: the `round`-th of each partition, in (ts, event_id) order."""
    return f"""(
    SELECT kind, model, node, ts, event_id, payload AS p,
           row_number() OVER (PARTITION BY {partition} ORDER BY ts, event_id) AS round
    FROM {source} WHERE kind IN ('{_STARTED}', '{_FINISHED}')
) AS e
WHERE round = $1"""


def _runs_round(source: str) -> str:
    return f"""
INSERT INTO runs AS r ({_CANDIDATE_COLUMNS}, served_attempt)
SELECT {_CANDIDATE},
       CASE WHEN kind = '{_FINISHED}' AND (p->>'served')::boolean THEN (p->>'attempt')::integer END
FROM {_round(source, "payload->>'request_id'")}
-- Sorted so concurrent recorders lock rows in the same order.
ORDER BY 1
ON CONFLICT (request_id) DO UPDATE SET
    {_merge(_ATTEMPT_COLUMNS, _RUNS_WINS)}
"""


def _attempts_round(source: str) -> str:
    return f"""
INSERT INTO run_attempts AS r ({_CANDIDATE_COLUMNS}, served)
SELECT {_CANDIDATE},
       CASE WHEN kind = '{_FINISHED}' THEN (p->>'served')::boolean END
FROM {_round(source, "payload->>'request_id', payload->>'attempt'")}
ORDER BY 1, (p->>'attempt')::integer
ON CONFLICT (request_id, attempt) DO UPDATE SET
    {_merge((*_OUTCOME_COLUMNS, "served"), _ATTEMPT_WINS)}
"""


def _admission(source: str) -> str:
    return f"""
INSERT INTO admission_events (
    event_id, ts, model, node, request_id, principal, decision, detail,
    pending, in_flight, retry_after_s, waited_ms
)
SELECT event_id, ts, model, node, p->>'request_id', p->>'principal', p->>'decision', p->>'detail',
       (p->>'pending')::integer, (p->>'in_flight')::integer, (p->>'retry_after_s')::float8, (p->>'waited_ms')::float8
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_ADMISSION}') AS e
ON CONFLICT (event_id) DO NOTHING
"""


def _nodes(source: str) -> str:
    return f"""
INSERT INTO nodes (event_id, ts, node, model, status, version, models, slots, free_slots, kv_usage)
SELECT event_id, ts, node, model, p->>'status', p->>'version',
       ARRAY(SELECT jsonb_array_elements_text(p->'models')),
       (p->>'slots')::integer, (p->>'free_slots')::integer, (p->>'kv_usage')::float8
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_NODE}') AS e
ON CONFLICT (event_id) DO NOTHING
"""


def _bench_runs(source: str) -> str:
    # Later (ts, event_id) wins, inside the batch (DISTINCT ON) and against the stored row (WHERE).
    return f"""
INSERT INTO bench_runs AS b (
    run_id, event_id, ts, model, node, target, scenario, config, results, started_at, finished_at
)
SELECT DISTINCT ON (p->>'run_id')
       p->>'run_id', event_id, ts, model, node, p->>'target', p->>'scenario', p->'config', p->'results',
       to_timestamp((p->>'started_at')::float8), to_timestamp((p->>'finished_at')::float8)
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_BENCH_RUN}') AS e
ORDER BY p->>'run_id', ts DESC, event_id DESC
ON CONFLICT (run_id) DO UPDATE SET
    event_id = EXCLUDED.event_id, ts = EXCLUDED.ts, model = EXCLUDED.model, node = EXCLUDED.node,
    target = EXCLUDED.target, scenario = EXCLUDED.scenario, config = EXCLUDED.config,
    results = EXCLUDED.results, started_at = EXCLUDED.started_at, finished_at = EXCLUDED.finished_at
WHERE (EXCLUDED.ts, EXCLUDED.event_id) > (b.ts, b.event_id)
"""


def _scores(source: str) -> str:
    return f"""
INSERT INTO scores (event_id, ts, run_id, model, node, scenario, metric, value, unit, scorer)
SELECT event_id, ts, p->>'run_id', model, node, p->>'scenario', p->>'metric',
       (p->>'value')::float8, p->>'unit', p->>'scorer'
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_SCORE}') AS e
ON CONFLICT (event_id) DO NOTHING
"""


def _preemptions(source: str) -> str:
    return f"""
INSERT INTO preemptions (event_id, ts, request_id, model, node, reason, service_class, tokens_kept)
SELECT event_id, ts, p->>'request_id', model, node, p->>'reason', p->>'service_class',
       (p->>'tokens_kept')::int
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_PREEMPTED}') AS e
ON CONFLICT (event_id) DO NOTHING
"""


def _responses_stored(source: str) -> str:
    # The latest (ts, event_id) stored event wins; a deletion already projected is kept.
    return f"""
INSERT INTO responses AS r (
    response_id, event_id, ts, model, principal, previous_response_id, status, input_items, response, stored_bytes
)
SELECT DISTINCT ON (p->>'response_id')
       p->>'response_id', event_id, ts, model, p->>'principal', p->>'previous_response_id',
       p->'response'->>'status', p->'input_items', p->'response',
       octet_length((p->'input_items')::text) + octet_length((p->'response')::text)
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_RESPONSE_STORED}') AS e
ORDER BY p->>'response_id', ts DESC, event_id DESC
ON CONFLICT (response_id) DO UPDATE SET
    event_id = EXCLUDED.event_id, ts = EXCLUDED.ts, model = EXCLUDED.model, principal = EXCLUDED.principal,
    previous_response_id = EXCLUDED.previous_response_id, status = EXCLUDED.status,
    input_items = EXCLUDED.input_items, response = EXCLUDED.response, stored_bytes = EXCLUDED.stored_bytes
WHERE r.event_id IS NULL OR (EXCLUDED.ts, EXCLUDED.event_id) > (r.ts, r.event_id)
"""


def _deleted(table: str, id_field: str, kind: str, source: str) -> str:
    """The earliest (ts, event_id) deletion of each id in `table` wins, whether or not the event
    that made the row came first."""
    return f"""
INSERT INTO {table} AS t ({id_field}, deleted_at, deleted_by)
SELECT DISTINCT ON (p->>'{id_field}') p->>'{id_field}', ts, event_id
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{kind}') AS e
ORDER BY p->>'{id_field}', ts, event_id
ON CONFLICT ({id_field}) DO UPDATE SET deleted_at = EXCLUDED.deleted_at, deleted_by = EXCLUDED.deleted_by
WHERE t.deleted_at IS NULL OR (EXCLUDED.deleted_at, EXCLUDED.deleted_by) < (t.deleted_at, t.deleted_by)
"""


def _responses_deleted(source: str) -> str:
    return _deleted("responses", "response_id", _RESPONSE_DELETED, source)


def _responses_erased(source: str) -> str:
    # The content of every deleted response this source mentions goes, in its row and in `events`.
    return f"""
WITH gone AS (
    SELECT response_id FROM responses
    WHERE deleted_at IS NOT NULL AND response_id IN (
        SELECT payload->>'response_id' FROM {source} WHERE kind IN ('{_RESPONSE_STORED}', '{_RESPONSE_DELETED}'))
), rows AS (
    UPDATE responses SET input_items = NULL, response = NULL, status = NULL, stored_bytes = 0
    WHERE response_id IN (SELECT response_id FROM gone) AND (input_items IS NOT NULL OR response IS NOT NULL)
)
UPDATE events SET payload = (payload - 'input_items' - 'response') || '{ERASED_CONTENT}'::jsonb
WHERE kind = '{_RESPONSE_STORED}' AND payload->>'response_id' IN (SELECT response_id FROM gone)
  AND NOT payload @> '{ERASED_CONTENT}'::jsonb
"""


def _files_created(source: str) -> str:
    # One file.created per id; a replayed or repeated one changes nothing, a deletion is kept.
    return f"""
INSERT INTO files AS f (file_id, event_id, ts, principal, filename, purpose, bytes, created_at)
SELECT DISTINCT ON (p->>'file_id')
       p->>'file_id', event_id, ts, p->>'principal', p->>'filename', p->>'purpose',
       (p->>'bytes')::bigint, (p->>'created_at')::bigint
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_FILE_CREATED}') AS e
ORDER BY p->>'file_id', ts, event_id
ON CONFLICT (file_id) DO UPDATE SET
    event_id = EXCLUDED.event_id, ts = EXCLUDED.ts, principal = EXCLUDED.principal, filename = EXCLUDED.filename,
    purpose = EXCLUDED.purpose, bytes = EXCLUDED.bytes, created_at = EXCLUDED.created_at
WHERE f.event_id IS NULL OR (EXCLUDED.ts, EXCLUDED.event_id) < (f.ts, f.event_id)
"""


def _files_deleted(source: str) -> str:
    return _deleted("files", "file_id", _FILE_DELETED, source)


# What an erased response.stored payload holds instead of its input items and response object.
ERASED_CONTENT = '{"input_items": [], "response": {}, "erased": true}'



def _batches_created(source: str) -> str:
    # One batch.created per id; the statuses already known are kept.
    return f"""
INSERT INTO batches AS b (batch_id, event_id, principal, input_file_id, endpoint, completion_window, metadata,
                          created_at, expires_at)
SELECT DISTINCT ON (p->>'batch_id')
       p->>'batch_id', event_id, p->>'principal', p->>'input_file_id', p->>'endpoint', p->>'completion_window',
       p->'metadata', (p->>'created_at')::bigint, (p->>'expires_at')::bigint
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_BATCH_CREATED}') AS e
ORDER BY p->>'batch_id', ts, event_id
ON CONFLICT (batch_id) DO UPDATE SET
    event_id = EXCLUDED.event_id, principal = EXCLUDED.principal, input_file_id = EXCLUDED.input_file_id,
    endpoint = EXCLUDED.endpoint, completion_window = EXCLUDED.completion_window, metadata = EXCLUDED.metadata,
    created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
WHERE b.event_id IS NULL
"""


_STATUS_TIMES = ("in_progress", "cancelling", "finalizing", "completed", "failed", "expired", "cancelled")


def _batches_status(source: str) -> str:
    # The furthest status wins (the first reported among equals), each status's earliest time, and
    # the first total, file ids and errors reported.
    firsts = ",\n       ".join(f"min((p->>'at')::bigint) FILTER (WHERE p->>'status' = '{s}')" for s in _STATUS_TIMES)
    columns = ", ".join(f"{s}_at" for s in _STATUS_TIMES)
    keep = ",\n    ".join(f"{s}_at = least(b.{s}_at, EXCLUDED.{s}_at)" for s in _STATUS_TIMES)
    return f"""
INSERT INTO batches AS b (batch_id, status, status_rank, total, output_file_id, error_file_id, errors, {columns})
SELECT p->>'batch_id', (array_agg(p->>'status' ORDER BY rank DESC, ts, event_id))[1], max(rank),
       max((p->>'total')::integer), max(p->>'output_file_id'), max(p->>'error_file_id'),
       (array_agg(p->'errors' ORDER BY ts, event_id) FILTER (WHERE jsonb_typeof(p->'errors') = 'array'))[1],
       {firsts}
FROM (SELECT *, payload AS p,
             CASE payload->>'status' WHEN 'validating' THEN 0 WHEN 'in_progress' THEN 1 WHEN 'cancelling' THEN 2
                                     WHEN 'finalizing' THEN 3 ELSE 4 END AS rank
      FROM {source} WHERE kind = '{_BATCH_STATUS}') AS e
GROUP BY p->>'batch_id'
ON CONFLICT (batch_id) DO UPDATE SET
    status = CASE WHEN EXCLUDED.status_rank > b.status_rank THEN EXCLUDED.status ELSE b.status END,
    status_rank = greatest(b.status_rank, EXCLUDED.status_rank),
    total = coalesce(b.total, EXCLUDED.total),
    output_file_id = coalesce(b.output_file_id, EXCLUDED.output_file_id),
    error_file_id = coalesce(b.error_file_id, EXCLUDED.error_file_id),
    errors = coalesce(b.errors, EXCLUDED.errors),
    {keep}
"""


def _batch_lines(source: str) -> str:
    # The first answer of a line wins; a line (or custom_id) already recorded changes nothing.
    return f"""
INSERT INTO batch_lines (batch_id, line, custom_id, event_id, ts, status_code, request_id, body, error)
SELECT DISTINCT ON (p->>'batch_id', (p->>'line')::integer)
       p->>'batch_id', (p->>'line')::integer, p->>'custom_id', event_id, ts, (p->>'status_code')::integer,
       p->>'request_id', nullif(p->'body', 'null'::jsonb), nullif(p->'error', 'null'::jsonb)
FROM (SELECT *, payload AS p FROM {source} WHERE kind = '{_BATCH_LINE}') AS e
ORDER BY p->>'batch_id', (p->>'line')::integer, ts, event_id
ON CONFLICT DO NOTHING
"""






_NOTICES = (
    (frozenset({_RESPONSE_STORED, _RESPONSE_DELETED}), RESPONSES_CHANNEL, "response_id"),
    (frozenset({_FILE_CREATED, _FILE_DELETED}), FILES_CHANNEL, "file_id"),
    (frozenset({_BATCH_CREATED, _BATCH_STATUS}), BATCHES_CHANNEL, "batch_id"),
)


def _notify(channel: str, id_field: str, kinds: frozenset[str], source: str) -> str:
    listed = ", ".join(f"'{kind}'" for kind in sorted(kinds))
    return f"SELECT pg_notify('{channel}', left(payload->>'{id_field}', 256)) FROM {source} WHERE kind IN ({listed})"


class Statements:
    """The projection statements reading one source table."""

    def __init__(self, source: str) -> None:
        self.responses_erased = _responses_erased(source)
        self.erasing_kinds = frozenset({_RESPONSE_STORED, _RESPONSE_DELETED})
        # What each batch NOTIFYs (delivered at commit), by the kinds that change those rows.
        self.notices = tuple((kinds, _notify(channel, field, kinds, source)) for kinds, channel, field in _NOTICES)
        self.run_rounds = (_runs_round(source), _attempts_round(source))
        self.by_kind = {
            _ADMISSION: _admission(source),
            _NODE: _nodes(source),
            _BENCH_RUN: _bench_runs(source),
            _SCORE: _scores(source),
            _PREEMPTED: _preemptions(source),
            _RESPONSE_STORED: _responses_stored(source),
            _RESPONSE_DELETED: _responses_deleted(source),
            _FILE_CREATED: _files_created(source),
            _FILE_DELETED: _files_deleted(source),
            _BATCH_CREATED: _batches_created(source),
            _BATCH_STATUS: _batches_status(source),
            _BATCH_LINE: _batch_lines(source),
        }
        self.max_rounds = f"""
SELECT coalesce(max(n), 0) FROM (
    SELECT count(*) AS n FROM {source} WHERE kind IN ('{_STARTED}', '{_FINISHED}') GROUP BY payload->>'request_id'
) AS per_request
"""
