"""`helexa bench`: measure any OpenAI-compatible endpoint and record the numbers on EVENTS (SPEC §10)."""
