"""The model: the full-bandwidth wrapper (FullBandwidthLM), its fusion unit, configs and loading, SmolLM2.
The engine that runs it lives in engine/, training in training/ (docs/design.md)."""
