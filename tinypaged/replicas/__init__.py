"""tinypaged on Ray Serve: engine replicas behind an ingress and a KV-aware request router (docs/replicas.md).
Needs the `ray` extra; nothing outside this package imports it."""
