-- Stored responses are bounded and deletable for real (issue 35).
--
-- `stored_bytes` is the size of a response's stored JSON (its input items and response object), so
-- a conversation's `previous_response_id` chain is cut at a byte budget inside the recursive query
-- that reads it. A deleted response keeps its id, owner, predecessor and dates; its content goes,
-- from its row and from the response.stored payloads of `events` (the projector erases it from now
-- on; the statements below erase what was deleted before this migration).

ALTER TABLE responses ADD COLUMN stored_bytes bigint NOT NULL DEFAULT 0;

UPDATE responses
SET stored_bytes = coalesce(octet_length(input_items::text), 0) + coalesce(octet_length(response::text), 0);

-- The response.stored events of one response, found when it is deleted.
CREATE INDEX events_stored_response_idx ON events ((payload->>'response_id')) WHERE kind = 'response.stored';

UPDATE responses SET input_items = NULL, response = NULL, status = NULL, stored_bytes = 0
WHERE deleted_at IS NOT NULL;

UPDATE events e
SET payload = (e.payload - 'input_items' - 'response') || '{"input_items": [], "response": {}, "erased": true}'::jsonb
FROM responses r
WHERE e.kind = 'response.stored' AND r.deleted_at IS NOT NULL AND e.payload->>'response_id' = r.response_id;
