"""Causal interventions on the fed-back state (docs/design.md, Interventions): patching, ablation, subspace, dose, layers."""

from common.errors import quiet_import_interrupts

quiet_import_interrupts(__name__)  # a Ctrl-C while `python -m interventions.X` imports: one line
