"""Model side: the full-bandwidth wrapper, its fusion unit, the prefill engine, presets and training."""
