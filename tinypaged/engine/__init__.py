"""The engine, in four layers; each sub-package's docstring says its job.

- `frontend/`: what the server and `LLM` talk to. One client (`EngineClient`) over two transports: the
  engine stepped in this process, or an engine core in a process of its own; the wire format between them,
  the per-request output streams, the liveness watchdog.
- `step/`: one engine step (`LLMEngine.step`): check and queue requests, schedule, run the model, sample,
  append tokens, stop, report outputs and statistics.
- `sampling/`: how a row of logits becomes tokens: the sampler, and the request strategies that decide which
  draws to make and what they mean (parallel sampling, beam search), with the grammars of structured outputs.
- `device/`: the tensors: the model runner, its staged inputs, the executor and its tensor-parallel workers.

`request.py` is the vocabulary the layers share: a request as the engine holds it, and the plan a strategy
answers with. The direction (tests/test_layers.py): the frontend and sampling never import the device side,
the device side imports no other layer, and nothing below the frontend imports it.
"""
