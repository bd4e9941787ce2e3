"""Chi-square goodness of fit for the statistical losslessness tests (no scipy needed)."""

from __future__ import annotations

import numpy as np
import torch


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test of ``observed`` counts against ``expected_probs``.

    Bins whose expected count is below ``min_expected`` are pooled into one bin (the usual validity rule);
    an observation in a bin of probability 0 makes the p-value 0.
    """
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(expected_probs, dtype=np.float64)
    probs = probs / probs.sum()
    n = observed.sum()
    if np.any((probs == 0) & (observed > 0)):
        return 0.0
    expected = probs * n
    small = expected < min_expected
    obs = np.concatenate([observed[~small], [observed[small].sum()]]) if small.any() else observed
    exp = np.concatenate([expected[~small], [expected[small].sum()]]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = len(obs) - 1
    if dof < 1:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    # Survival function of chi2(dof) = regularised upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))
