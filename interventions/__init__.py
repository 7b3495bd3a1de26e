"""Causal interventions on the fed-back state (docs/design.md, Interventions): patching, ablation, subspace, dose, layers."""
