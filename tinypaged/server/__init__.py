"""The OpenAI-compatible HTTP server: aiohttp app (app.py), msgspec schema (protocol.py; the chat messages and
tools it carries: messages.py), the endpoints (completions.py, chat.py) over what they share (serving.py: checks
and the engine's streams; errors.py: the engine's errors as HTTP ones; chat_template.py: messages as the template
reads them; responses.py: the one response/stream loop; formatting.py: logprobs) and Prometheus metrics
(metrics.py). It never touches tensors."""
