"""Statistics shared by probes and interventions (below both; no model runs): the cluster bootstrap (bootstrap),
the grouped-CV linear probe and its estimator (linear, estimator), LEACE erasure fitted per grouped fold
(erasure)."""
