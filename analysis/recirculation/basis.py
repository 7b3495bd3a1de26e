"""(d) The basis test: z_s injected as is, after a small rotation, after a Haar-random orthogonal matrix (Haar on
O(D): a rotation or, for half the seeds, a reflection; either scrambles the basis). If the shallow layer reads the
deep state in a shared basis, a change of basis should hurt."""
from __future__ import annotations

import math

import torch

from analysis.recirculation.perplexity import pct
from analysis.recirculation.study import Study
from common.cli import derived_seed


def random_rotation(d: int, angle: float | None = None, seed: int = 0) -> torch.Tensor:
    """A D x D orthogonal matrix: Haar-random (angle None), or exp of a random skew matrix scaled so that the
    rotation turns a typical vector by about `angle` radians (a 'small rotation')."""
    g = torch.Generator().manual_seed(seed)
    if angle is None:
        q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))[None]).float()
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    skew = (a - a.T) / math.sqrt(2 * d)  # ||skew x|| ~ ||x|| for a typical x
    return torch.linalg.matrix_exp(angle * skew).float()


def basis_test(st: Study, best_spec, best_test: dict) -> None:
    """(d) on the held-out split at the tuned config."""
    a, b = st.a, st.E_test.base
    D = st.model.d_model
    small = random_rotation(D, angle=a.small_angle, seed=derived_seed(a.seed, 1))
    haar = random_rotation(D, seed=derived_seed(a.seed, 2))
    basis = {"identity": best_test["test_ppl_change_pct"]}
    kls = {"identity": best_test["test_kl"]}
    for name, R in (("small_rotation", small), ("random_orthogonal", haar)):
        e = st.E_test.run(st.rlm(st.spec(best_spec.source, best_spec.target, best_spec.alpha, best_spec.mode,
                                         transform=R)))
        basis[name], kls[name] = pct(e, b), e.kl
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(0))
    cos_small = float(torch.nn.functional.cosine_similarity(x, x @ small.T).mean())
    st.res["basis"] = {"ppl_change_pct": basis, "kl": kls, "small_rotation_mean_cos": cos_small,
                       "small_angle_rad": a.small_angle}
    print(f"[d] basis: identity {basis['identity']:+.3f}%, small rotation (cos {cos_small:.3f}) "
          f"{basis['small_rotation']:+.3f}%, random orthogonal {basis['random_orthogonal']:+.3f}%", flush=True)
