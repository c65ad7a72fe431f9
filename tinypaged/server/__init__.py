"""The OpenAI-compatible HTTP server: aiohttp app (app.py), msgspec schema (protocol.py), the endpoints
(completions.py, chat.py) over what they share (serving.py: checks and the engine's streams; responses.py: the
one response/stream loop; formatting.py: logprobs) and Prometheus metrics (metrics.py). It never touches
tensors."""
