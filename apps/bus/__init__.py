"""The bus: every subject name, stream/consumer/KV config and wire type lives in this package.

`apps.bus.wire` holds the msgspec Structs (no NATS, no torch); `apps.bus.topology` names the
subjects and declares the JetStream streams, consumers and the node registry bucket.
Nothing outside this package spells a subject string.
"""
