"""KV-cache events, vLLM's schema and wire protocol: the engine collects them (collector.py), the worker
publishes them over ZMQ (publisher.py), a prefix-aware router subscribes (subscriber.py). One definition of the
messages (schema.py) and of their framing and sequence numbers (wire.py) for all three."""
