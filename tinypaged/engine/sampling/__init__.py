"""From logits to tokens: the sampler (one batched pass for every draw of a step, `sampler.py`), a step's draws as
one batch with the search for the requests at fault (`draw_batch.py`), the request strategies that say which draws
to make and what they mean (parallel sampling, beam search), and structured outputs: grammars compiled
(`structured.py`), the engine's grammar admission and token masks (`grammar_state.py`). Works on a step's logits
and plain request data; never imports the device side."""
