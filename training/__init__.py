"""Training: recipes (config, presets), data, objectives (loss), the loop (one process or DDP under torchrun),
checkpoints and output directories, the CLI (`python -m training.train`) and model cards (`training.card`)."""
