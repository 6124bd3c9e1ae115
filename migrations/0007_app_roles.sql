-- One PostgreSQL role per app, each with the grants it needs and no more (issue 35). Only the
-- owner, who runs the migrations (`helexa up`, `helexa migrate`), changes the schema.
--
-- The roles are made here without a password and NOLOGIN; whoever runs the database lets them log
-- in with one (`helexa up` does it at every start: ALTER ROLE … LOGIN PASSWORD '…'). Roles belong to
-- the whole cluster, so a second database migrated on the same server finds them made already.
--
-- helexa_gateway:  reads stored responses (previous_response_id, GET /v1/responses), nothing else.
-- helexa_recorder: writes the ledger (every table the migrations make, now and later).
-- helexa_reader:   reads the ledger, for analysts, `psql` from `.helexa/env` and `helexa bench report`.

DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['helexa_gateway', 'helexa_recorder', 'helexa_reader'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's migration made it meanwhile
            END;
        END IF;
    END LOOP;
END
$$;

GRANT USAGE ON SCHEMA public TO helexa_gateway, helexa_recorder, helexa_reader;

GRANT SELECT ON responses TO helexa_gateway;

GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO helexa_recorder;
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON schema_migrations FROM helexa_recorder;
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO helexa_recorder;

GRANT SELECT ON ALL TABLES IN SCHEMA public TO helexa_reader;

-- Tables and sequences later migrations make (as the same owner) come with the same grants.
ALTER DEFAULT PRIVILEGES IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES TO helexa_recorder;
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO helexa_recorder;
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO helexa_reader;
