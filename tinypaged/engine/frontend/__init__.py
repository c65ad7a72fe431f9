"""The engine as its clients (the HTTP server, `LLM`'s async users, tests) see it: submit a request, stream its
outputs, abort it, watch the engine's health. One client over two transports: in this process (a step thread)
or an engine core in a child process (pipes, `wire.py`). Imports the step, never the device side."""
