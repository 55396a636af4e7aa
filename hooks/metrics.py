"""Evaluation metrics over whole data sets: exact AUC, log loss, calibration.

``Metrics`` accumulates (label, score) pairs batch by batch and computes the
exact ROC AUC at the end (rank statistic with ties shared), not a bucketed
approximation.
"""

from __future__ import annotations

import math

import numpy as np


def _check_scores(labels: np.ndarray, scores: np.ndarray) -> None:
    """Same length, every score and label finite; else ValueError naming the first."""
    if labels.shape != scores.shape:
        raise ValueError(f"{len(labels)} labels for {len(scores)} scores")
    for what, values in (("score", scores), ("label", labels)):
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise ValueError(
                f"{what} {int(bad[0])} is {values[bad[0]]} ({len(bad)} non-finite {what}s)"
            )


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with average ranks for ties); nan if one
    class is missing. A NaN or infinite score or label raises ValueError."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    raw = np.asarray(labels, dtype=np.float64).ravel()
    _check_scores(raw, scores)
    labels = raw > 0.5
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Average rank of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    average = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(average, ends - starts)
    u = ranks[labels].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


def logloss(labels: np.ndarray, scores: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps]);
    a NaN or infinite score or label raises ValueError."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=np.float64).ravel()
    _check_scores(y, scores)
    p = np.clip(scores, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


class Metrics:
    """Accumulates a binary task's labels and predicted probabilities."""

    def __init__(self) -> None:
        self._labels: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._loss_sum = 0.0  # batch losses weighted by batch size
        self._loss_rows = 0

    def update(self, labels: np.ndarray, scores: np.ndarray, loss: float | None = None) -> None:
        self._labels.append(np.asarray(labels, dtype=np.float32).ravel())
        self._scores.append(np.asarray(scores, dtype=np.float32).ravel())
        if loss is not None:  # a batch's mean: weighted by its rows
            rows = len(self._labels[-1])
            self._loss_sum += float(loss) * rows
            self._loss_rows += rows

    def result(self) -> dict[str, float]:
        """auc, logloss, calibration, mean_prediction, mean_label, examples
        (and loss when batch losses were given); NaN metrics of no examples."""
        if not sum(map(len, self._labels)):
            nan = math.nan
            names = ("auc", "logloss", "calibration", "mean_prediction", "mean_label")
            return {**dict.fromkeys(names, nan), "examples": 0, "loss": nan}
        y = np.concatenate(self._labels)
        p = np.concatenate(self._scores)
        mean_label = float(y.mean())
        out = {
            "auc": auc(y, p),
            "logloss": logloss(y, p),
            "calibration": float(p.mean() / mean_label) if mean_label > 0 else math.nan,
            "mean_prediction": float(p.mean()),
            "mean_label": mean_label,
            "examples": len(y),
        }
        if self._loss_rows:
            out["loss"] = self._loss_sum / self._loss_rows
        return out
