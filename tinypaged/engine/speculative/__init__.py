"""Speculative decoding: proposers guess the next tokens of a sequence (n-gram prompt lookup, a draft model, an
oracle for benchmarks: `proposers.py`, `draft_model.py`), and the engine's speculator decides each step which
sequences speculate and keeps the acceptance counts (`speculator.py`); the target verifies the proposals in
its own forward pass, by rejection sampling (`sampling/rejection.py`). docs/speculative.md walks through it."""
