"""From logits to tokens: the sampler (one batched pass for every draw of a step), the request strategies that
say which draws to make and what they mean (parallel sampling, beam search), and structured outputs' grammars
and token masks. Works on a step's logits and plain request data; never imports the device side."""
