"""Minimum description length of the labels given the representation: the online code of Voita & Titov
(2020, "Information-Theoretic Probing with Minimum Description Length"), with the project's probe.

The data are cut into blocks of whole GROUPS (never of samples: a pair is never split between what the probe
was trained on and what it encodes). The groups are dealt into `n_chunks` stratified chunks by the same
machinery as the probes' outer folds (StratifiedGroupKFold(shuffle=True, random_state) over the groups, each
chunk one of its test folds, in order); block boundaries lie at chunk counts c0, 2 c0, 4 c0, ..., n_chunks
(Voita & Titov's doubling timesteps), c0 being the fewest leading chunks whose groups hold every class in
at least two groups (so the first probe knows every class and can choose C by its inner grouped CV).

    uniform code length   L_unif   = n log2 K                                  (bits)
    online code length    L_online = n_1 log2 K + sum_i sum_{j in block i+1} -log2 p_i(y_j | x_j)
                          p_i = a `stats.linear.LinearProbe` fitted on blocks 1..i; probabilities = sigmoid /
                          softmax of its decision_function over the sorted training classes (scikit-learn's
                          order). Its C (from ProbeConfig.Cs) is chosen by inner grouped CV on those rows only,
                          by held-out LOG LOSS, not accuracy: the code length is the log loss, and accuracy ties
                          (every C separates the training rows) would pick the strongest regularization, whose
                          under-confident probabilities cost ~1 bit per sample however clear the labels are.
    compression           L_unif / L_online: ~1 when the labels cannot be read off the representation (or a
                          probe cannot learn them from little data), large when a few examples suffice.

The probe is the project's, K > 2 included: a class-balanced multinomial (stats.estimator), so over K > 2
classes its probabilities carry no class prior, and labels that are imbalanced within the blocks cost more than
the best code would charge (constant features, labels 30/15/15: 95.1 bits against 90.7 for the class
frequencies, compression 1.00 vs 1.05). The tasks' classes are near balanced; a compression near 1 on a strongly
imbalanced K-way task is this, not the representation. Two classes are fitted without weights.

Unlike accuracy, the code length also charges for how much data the probe needs to get there (and for
confident mistakes), so it separates a representation that makes the label easy from one where a probe
memorizes (Voita & Titov, section 2). probes.json rows carry `mdl_online_bits`, `mdl_uniform_bits` and
`mdl_compression`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.model_selection import StratifiedGroupKFold

from common.errors import UserError
from stats.linear import ProbeConfig, fold_fits

DEFAULT_CHUNKS = 64  # at most; fewer when a class occurs in fewer groups
MDL_FIELDS = ("mdl_online_bits", "mdl_uniform_bits", "mdl_compression")
LOG2 = np.log(2.0)


@dataclass(frozen=True)
class BlockPlan:
    order: np.ndarray  # row indices, chunk by chunk
    ends: tuple  # block ends in rows of `order`: block i is order[ends[i-1]:ends[i]] (ends[-1] = n)
    n_chunks: int
    # per encoded block i+1: the inner grouped-CV splits choosing C on the rows order[:ends[i]] (indices into
    # them; None: no search, the middle C). They depend only on labels, groups and the config, so every depth
    # shares them (_c_splits).
    inner: tuple = ()


def block_plan(y, groups, config: ProbeConfig = ProbeConfig(), n_chunks: int = DEFAULT_CHUNKS) -> BlockPlan:
    """Rows ordered in stratified chunks of whole groups and the doubling block boundaries (module doc)."""
    y, groups = np.asarray(y), np.asarray(groups)
    classes = np.unique(y)
    if len(classes) < 2:
        raise UserError("MDL needs at least two label classes")
    per_class = min(len(np.unique(groups[y == c])) for c in classes)
    k = min(int(n_chunks), per_class)
    if k < 2:
        raise UserError(f"MDL needs every class in at least 2 groups (the least frequent is in {per_class})")
    cv = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=config.random_state)
    chunks = [te for _, te in cv.split(np.zeros(len(y)), y, groups)]
    order = np.concatenate(chunks)
    sizes = np.cumsum([len(c) for c in chunks])
    c0 = None
    for i in range(1, k + 1):  # fewest leading chunks with every class in >= 2 groups
        rows = order[:sizes[i - 1]]
        if all(len(np.unique(groups[rows][y[rows] == c])) >= 2 for c in classes):
            c0 = i
            break
    if c0 is None or c0 == k:
        raise UserError("too few groups for an online code: the first block would need every group")
    ends, c = [], c0
    while c < k:
        ends.append(int(sizes[c - 1]))
        c *= 2
    ends.append(int(sizes[-1]))
    inner = tuple(_c_splits(y[order[:a]], groups[order[:a]], config) for a in ends[:-1])
    return BlockPlan(order, tuple(ends), k, inner)


_PLANS: dict = {}  # depth_mdl's plans, by (labels, groups, config): the modes of one N share them


def _cached_plan(y, groups, config: ProbeConfig) -> BlockPlan:
    y, groups = np.asarray(y), np.asarray(groups)
    key = (y.dtype.str, y.tobytes(), groups.dtype.str, groups.tobytes(), config)
    if key not in _PLANS:
        if len(_PLANS) >= 8:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = block_plan(y, groups, config)
    return _PLANS[key]


def _neg_log2_prob(scores: np.ndarray, classes: np.ndarray, y: np.ndarray, missing_ok: bool = False) -> np.ndarray:
    """-log2 p(y | x) from decision_function scores: binary [n] (logit of classes[1]) or [n, K].

    `missing_ok` (inner CV only): a row whose class the probe never saw costs log2 of the number of classes it
    knows + 1 (a fixed escape charge; the outer blocks always see every class)."""
    idx = np.searchsorted(classes, y)
    unseen = (idx >= len(classes)) | (classes[np.minimum(idx, len(classes) - 1)] != y)
    if unseen.any():
        if not missing_ok:
            raise UserError("an MDL block was trained without every class")
        out = np.full(len(y), np.log2(len(classes) + 1))
        seen = ~unseen
        if seen.any():
            out[seen] = _neg_log2_prob(scores[seen], classes, y[seen])
        return out
    if scores.ndim == 1:
        s = np.where(idx == 1, scores, -scores)  # log p(y) = -log(1 + exp(-s))
        return np.logaddexp(0.0, -s) / LOG2
    m = scores.max(1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(scores - m).sum(1))
    return (lse - scores[np.arange(len(y)), idx]) / LOG2


@dataclass
class MDLScore:
    online_bits: float
    uniform_bits: float
    block_bits: list  # bits of each block (the first: uniform)
    block_ends: list  # rows encoded after each block

    @property
    def compression(self) -> float:
        return self.uniform_bits / self.online_bits

    def fields(self) -> dict:
        return {"mdl_online_bits": self.online_bits, "mdl_uniform_bits": self.uniform_bits,
                "mdl_compression": self.compression}


def _c_splits(y, groups, config: ProbeConfig) -> list | None:
    """The inner grouped-CV splits on which _best_c chooses C (None: no choice to make, the middle C)."""
    # no more inner folds than groups holding the rarest class (StratifiedGroupKFold's requirement)
    k = min([config.inner_splits] + [len(np.unique(groups[y == c])) for c in np.unique(y)])
    if len(config.Cs) < 2 or k < 2:
        return None
    cv = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=config.random_state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "least populated class" on the smallest blocks
        splits = [(tr, te) for tr, te in cv.split(np.zeros(len(y)), y, groups) if len(np.unique(y[tr])) > 1]
    return splits or None


_SPLITS = object()  # _best_c: compute the C splits here


def _best_c(X, y, groups, config: ProbeConfig, splits=_SPLITS) -> float:
    """The C of config.Cs minimizing inner grouped-CV log loss on (X, y) (ties: smallest C; no search possible:
    the middle C); `splits`: _c_splits(y, groups, config), when the caller has them (a BlockPlan holds them)."""
    Cs = sorted(config.Cs)
    if splits is _SPLITS:
        splits = _c_splits(y, groups, config)
    if not splits:
        return Cs[len(Cs) // 2]
    # Each C's summed held-out log loss over the splits (in split order); every C of a split is fitted on its one
    # standardization and SVD (stats.linear.fold_fits): the probe LinearProbe with Cs=(C,) would fit.
    loss = [0.0] * len(Cs)
    for (tr, _), (te, fits) in zip(splits, fold_fits(X, y, splits, Cs, config.max_iter)):
        classes = np.unique(y[tr])
        for i, (_, dec) in enumerate(fits):
            loss[i] += float(_neg_log2_prob(dec, classes, y[te], missing_ok=True).sum())
    return Cs[int(np.argmin(loss))]  # argmin keeps the first (smallest C) of equal losses


def online_code(X, y, groups, config: ProbeConfig = ProbeConfig(), plan: BlockPlan | None = None) -> MDLScore:
    """Online code length of labels y given X [n, d] (module doc); `plan`: block_plan(y, groups, config) of the
    same labels, groups and config, shared across depths."""
    X = np.asarray(X, dtype=np.float64)
    y, groups = np.asarray(y), np.asarray(groups)
    if X.ndim != 2 or len(X) != len(y) or len(y) != len(groups):
        raise UserError("MDL needs X [n, d] with one label and one group per row")
    plan = plan or block_plan(y, groups, config)
    K = len(np.unique(y))
    order, ends = plan.order, plan.ends
    first = ends[0]
    bits = [first * np.log2(K)]  # the first block is sent with the uniform code
    for i, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        tr, te = order[:a], order[a:b]
        classes = np.unique(y[tr])  # decision_function columns follow the sorted training classes
        if len(classes) != K:
            raise UserError("an MDL block was trained without every class")  # excluded by block_plan
        C = _best_c(X[tr], y[tr], groups[tr], config, plan.inner[i] if plan.inner else _SPLITS)
        # LinearProbe(Cs=(C,)) fitted on the rows tr, its decision_function on te (fold_fits: the same numbers)
        (_, [(_, dec)]), = fold_fits(X, y, [(tr, te)], [C], config.max_iter)
        bits.append(float(_neg_log2_prob(dec, classes, y[te]).sum()))
    return MDLScore(float(sum(bits)), float(len(y) * np.log2(K)), [float(b) for b in bits], list(ends))


def mdl_meta(enabled: bool = True) -> dict:
    """probes.json meta.mdl: what the mdl_* fields are."""
    return {"enabled": bool(enabled),
            "method": "online code (Voita & Titov 2020) with stats.linear.LinearProbe, C by inner grouped-CV log loss",
            "blocks": f"up to {DEFAULT_CHUNKS} stratified chunks of whole groups (StratifiedGroupKFold, the probe "
                      "seed); blocks end at c0, 2 c0, 4 c0, ... chunks, c0 the fewest holding every class in 2 groups",
            "compression": "uniform code length (n log2 K) / online code length, in bits"}


def depth_mdl(acts, y, groups, config: ProbeConfig = ProbeConfig()) -> list[MDLScore]:
    """online_code per depth of activations [n, L+1, d], with one block plan for all depths (and for every call
    with the same labels, groups and config: the modes of one N)."""
    plan = _cached_plan(y, groups, config)
    return [online_code(acts[:, d], y, groups, config, plan) for d in range(acts.shape[1])]
