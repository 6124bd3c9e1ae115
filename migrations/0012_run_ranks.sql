-- On how many tensor-parallel ranks each run was served (issue 41): `tensor_parallel` of the
-- attempt that decides the row, from its run.started / run.finished events. NULL: not said (events
-- from before this migration, or a run.finished a gateway published for a worker that died).
ALTER TABLE runs ADD COLUMN tensor_parallel integer;
ALTER TABLE run_attempts ADD COLUMN tensor_parallel integer;
