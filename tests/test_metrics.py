"""wuliang.metrics: exact AUC with ties, log loss, accumulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from wuliang.metrics import Metrics, auc, logloss


def pairwise_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counting one half."""
    pos = scores[labels > 0.5].astype(np.float64)
    neg = scores[labels <= 0.5].astype(np.float64)
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


@pytest.mark.parametrize("levels", [2, 5, 50, None])
def test_auc_matches_the_pairwise_definition(rng: np.random.Generator, levels: int | None) -> None:
    for n in (2, 7, 300, 1000):
        labels = (rng.random(n) < 0.3).astype(np.float32)
        labels[:2] = [0.0, 1.0]  # both classes
        if levels is None:
            scores = rng.random(n).astype(np.float32)
        else:  # many equal scores
            scores = (rng.integers(0, levels, n) / levels).astype(np.float32)
        assert auc(labels, scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)


def test_auc_known_values() -> None:
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert auc(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4])) == 0.0
    assert auc(np.array([0, 1, 0, 1]), np.array([0.1, 0.5, 0.5, 0.9])) == pytest.approx(0.875)
    # order of the examples does not matter
    labels, scores = np.array([1, 0, 1, 0, 1]), np.array([0.3, 0.3, 0.9, 0.1, 0.3])
    perm = np.array([4, 2, 0, 3, 1])
    assert auc(labels, scores) == auc(labels[perm], scores[perm])


def test_auc_of_constant_scores_is_one_half(rng: np.random.Generator) -> None:
    labels = (rng.random(101) < 0.5).astype(np.float32)
    assert auc(labels, np.full(101, 0.37, np.float32)) == 0.5


def test_auc_is_nan_without_both_classes() -> None:
    assert math.isnan(auc(np.zeros(5), np.linspace(0, 1, 5)))
    assert math.isnan(auc(np.ones(5), np.linspace(0, 1, 5)))
    assert math.isnan(auc(np.zeros(0), np.zeros(0)))


def test_logloss_is_the_formula(rng: np.random.Generator) -> None:
    labels = (rng.random(200) < 0.4).astype(np.float32)
    scores = rng.uniform(0.01, 0.99, 200)
    want = -np.mean(labels * np.log(scores) + (1 - labels) * np.log(1 - scores))
    assert logloss(labels, scores) == pytest.approx(want, rel=1e-12)
    # 0 and 1 are clipped (finite), a confident mistake costs about -log(1e-7)
    assert logloss(np.array([1.0, 0.0]), np.array([1.0, 0.0])) == pytest.approx(0.0, abs=1e-6)
    assert logloss(np.array([1.0]), np.array([0.0])) == pytest.approx(-math.log(1e-7), rel=1e-6)


def test_metrics_accumulated_equal_one_shot(rng: np.random.Generator) -> None:
    labels = (rng.random(1000) < 0.25).astype(np.float32)
    scores = np.round(rng.random(1000), 2).astype(np.float32)  # ties across updates
    losses = rng.random(4)
    parts = np.array_split(np.arange(1000), 4)

    several = Metrics()
    for part, loss in zip(parts, losses, strict=True):
        several.update(labels[part], scores[part], loss)
    one = Metrics()
    one.update(labels, scores)
    result, whole = several.result(), one.result()

    for key in ("auc", "logloss", "calibration", "mean_prediction", "mean_label", "examples"):
        assert result[key] == pytest.approx(whole[key], rel=1e-12), key
    assert result["auc"] == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)
    assert result["examples"] == 1000
    assert result["mean_label"] == pytest.approx(labels.mean())
    assert result["calibration"] == pytest.approx(scores.mean() / labels.mean(), rel=1e-6)
    assert result["loss"] == pytest.approx(losses.mean())  # mean of the batch losses
    assert "loss" not in whole


def test_metrics_accepts_column_vectors_and_empty() -> None:
    m = Metrics()
    m.update(np.array([[0.0], [1.0]]), np.array([[0.2], [0.8]]))
    assert m.result()["auc"] == 1.0
    empty = Metrics().result()
    assert empty["examples"] == 0
    assert all(np.isnan(v) for k, v in empty.items() if k != "examples")


def test_loss_is_weighted_by_batch_rows() -> None:
    """Batch losses are means: a short last batch counts by its rows."""
    metrics = Metrics()
    metrics.update(np.array([1, 0, 1, 0]), np.full(4, 0.5), loss=1.0)
    metrics.update(np.array([1]), np.array([0.5]), loss=0.0)
    assert metrics.result()["loss"] == pytest.approx(0.8)
