"""What every text experiment of the study shares: the model, the two splits' evaluators, the arguments."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.recirculation import RecircSpec, RecirculatedLM


@dataclass
class Study:
    a: object  # the parsed CLI arguments
    model: object  # FullBandwidthLM without fusion
    E_tune: object  # perplexity.Evaluator on the tuning split
    E_test: object  # perplexity.Evaluator on the held-out split
    pairs: list
    alphas: list
    temps: list
    passes_list: list
    res: dict = field(default_factory=dict)  # results.json, filled by the experiments in order

    def spec(self, s, d, alpha, mode, **kw) -> RecircSpec:
        return RecircSpec(s, d, float(alpha), mode, ramp=self.a.ramp, **kw)

    def rlm(self, sp: RecircSpec) -> RecirculatedLM:
        return RecirculatedLM(self.model, sp)
