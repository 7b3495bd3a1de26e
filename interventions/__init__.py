"""Causal interventions on the fed-back state (SPEC section 5): patching, ablation, subspace, dose, layers."""
