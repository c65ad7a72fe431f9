"""One engine step: requests checked and tokenized (`inputs.py`), scheduled by core/, run on the device, their
draws sampled, their tokens appended, stop conditions checked and outputs built (`output_processor.py`), and
the step's statistics (`stats.py`). `LLMEngine` is the synchronous engine every frontend drives."""
