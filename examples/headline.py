"""The headline in 20 lines: does tiny-fbt-track *use* its fed-back state on parity at N = 64 update lines?"""
import torch

from interventions.core import Batch, CausalContext
from interventions.suite import Suite
from models.loading import load_model
from tasks import make_dataset

model, tok, _ = load_model("tiny-fbt-track")                           # the shipped checkpoints/tiny-fbt-track
samples = make_dataset("parity", n_pairs=8, n_distractors=64, seed=0)  # 8 pairs, each differing in one line
batch = Batch.from_samples(samples, tok, "parity")                     # left-padded: T is the last column
ctx = CausalContext(model, batch, modes=("standard", "recurrent-full"))  # clean runs, checked against the engine
suite = Suite(ctx)                                                     # metrics with group-bootstrap 95% CIs
answer = torch.tensor(batch.label_ids)[batch.labels]
print(f"parity, N = 64, {batch.size} samples: a small-sample check (the README's numbers use 100-200)")
for mode in ctx.modes:
    logits = ctx.clean[mode].logits                                    # [samples, vocab] at T
    vocab = (logits.argmax(-1) == answer).float().mean().item()        # argmax over the vocabulary (eval.json)
    words = suite.metrics(logits, mode, donor=torch.arange(batch.size))["accuracy"]  # between the label words
    print(f"{mode:>15}: accuracy {vocab:.3f} (full vocabulary), {words:.3f} (label words)")
swap = suite.metrics(ctx.swap_state(batch.pair))                       # the paired sample's h_{T-1} fed at T
lo, hi = swap["follows_donor_rate_ci"]
print(f"state swap at T (recurrent-full): follows donor {swap['follows_donor_rate']:.3f} [{lo:.3f}, {hi:.3f}], "
      f"normalized effect {swap['normalized_effect']:.2f}")
