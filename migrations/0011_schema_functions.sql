-- SQL functions live one to a file under migrations/functions/ and are re-applied by the migrator
-- whenever a file's text changes; this table keeps the sha256 of what each database last applied.
-- helexa_prune moved there: each migration used to repeat the whole function to add one table.
CREATE TABLE IF NOT EXISTS schema_functions (
    name       text PRIMARY KEY,
    sha256     text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- The recorder may read it (to see nothing is pending), not change it, as with schema_migrations.
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON schema_functions FROM helexa_recorder;
