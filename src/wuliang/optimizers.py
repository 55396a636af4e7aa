"""Optimizers applied to embeddings on the parameter server."""

from wuliang.ps_server.spec import FTRL, SGD, Adagrad, Adam, Optimizer

__all__ = ["FTRL", "SGD", "Adagrad", "Adam", "Optimizer"]
