"""The engine: the only code that runs a model (prefill modes, the recurrent step, Jacobi passes, generation).

Every other package is a client of it; see docs/design.md."""
