"""The recorder: projects the EVENTS stream into PostgreSQL.

`app` runs the consume → commit → ack loop, `projector` owns the SQL that turns a batch of
events into `events` rows and the projections (`runs`), `migrate` applies `migrations/*.sql`.
"""
