"""The OpenAI-compatible HTTP server: aiohttp app (app.py), msgspec schema (protocol.py), endpoint logic
(serving.py, formatting.py) and Prometheus metrics (metrics.py). It never touches tensors."""
