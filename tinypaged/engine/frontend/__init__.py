"""The engine as its clients (the HTTP server, `LLM`'s async users, tests) see it: submit a request, stream its
outputs, abort it, watch the engine's health. One client (`EngineClient`, client.py) over two transports that
only carry: `StepThread` (async_engine.py: the LLMEngine stepped in a thread of this process; `AsyncEngine`
builds the client over it) or `CoreProcess` (process_engine.py: an engine core in a child process,
core_process.py, over pipes, wire.py; `ProcessEngine`). Imports the step, never the device side."""
