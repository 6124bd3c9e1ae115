-- Uploaded files (/v1/files), projected from file.created and file.deleted events. The content is
-- object `file_id` of the NATS Object Store bucket `helexa_files`; this table knows who owns it,
-- what it is called, how large it is and whether it was deleted.
--
-- A row merges the two kinds in whatever order they arrive: the file's columns come from its
-- file.created (one per id), deleted_at from the earliest file.deleted. A row may exist with only
-- its deletion known (the file's columns still NULL).

CREATE TABLE files (
    file_id     text PRIMARY KEY,
    -- The file.created event the file's columns come from; NULL while only a deletion is known.
    event_id    text,
    ts          timestamptz,
    principal   text,
    filename    text,
    purpose     text,
    bytes       bigint,
    -- Unix seconds, the FileObject's `created_at`.
    created_at  bigint,
    deleted_at  timestamptz,
    deleted_by  text
);

-- A principal's files, newest first (GET /v1/files), and its quota (count and bytes of the live ones).
CREATE INDEX files_principal_created_idx ON files (principal, created_at, file_id);

GRANT SELECT ON files TO helexa_gateway;

-- Retention leaves files alone: a file is kept until its owner deletes it, so its row and the
-- events `--rebuild` makes the row from are not pruned by age (same signature as before).
CREATE OR REPLACE FUNCTION helexa_prune(older_than interval)
RETURNS TABLE (table_name text, deleted bigint)
LANGUAGE plpgsql AS $$
DECLARE
    cutoff timestamptz := now() - older_than;
    n bigint;
BEGIN
    -- A file's events stay as long as the file may (its row is rebuilt from them): pruned with it.
    DELETE FROM events WHERE ts < cutoff AND kind NOT IN ('file.created', 'file.deleted');
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
END
$$;
