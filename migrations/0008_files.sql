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

-- Retention (helexa_prune) is defined once, in migrations/functions/helexa_prune.sql.
