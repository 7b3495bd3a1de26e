from common.errors import quiet_import_interrupts

quiet_import_interrupts(__name__)  # a Ctrl-C while `python -m analysis.X` imports: one line
