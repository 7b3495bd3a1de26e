"""Training: recipes (config, presets), data, objectives (loss), the loop (one process or DDP under torchrun),
checkpoints and output directories, the CLI (`python -m training.train`) and model cards (`training.card`)."""

from common.errors import quiet_import_interrupts

quiet_import_interrupts(__name__)  # a Ctrl-C while `python -m training.X` imports: one line
