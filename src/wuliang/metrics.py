"""Evaluation metrics over whole data sets: exact AUC, log loss, calibration
(``wuliang.hooks.metrics``, beside the hooks that report them)."""

from wuliang.hooks.metrics import Metrics, auc, logloss

__all__ = ["Metrics", "auc", "logloss"]
