"""The model ``train_bench.py`` and ``cluster_bench.py`` train: 26
Criteo-like embeddings of dim ``DIM`` and 13 dense features into a Keras
MLP ``TOWER``-1, and the tower's optimizer. Keras is imported on first use."""

from __future__ import annotations

from typing import Any

from wuliang.reader.datagen import DENSE, SINGLE

__all__ = ["DIM", "TOWER", "make_tower", "tower_optimizer"]

DIM = 16  # every table's embedding dimension
TOWER = (512, 256, 128)  # the MLP's hidden layers (ReLU), then one logit


def make_tower(seed: int) -> Any:
    """The MLP over the 26 embeddings and the dense features, seeded."""
    import keras

    keras.utils.set_random_seed(seed)
    width = len(SINGLE) * DIM + len(DENSE)
    return keras.Sequential(
        [
            keras.Input((width,)),
            *(keras.layers.Dense(units, activation="relu") for units in TOWER),
            keras.layers.Dense(1),
        ]
    )


def tower_optimizer(kind: str) -> Any:
    """The tower's optimizer: Adagrad(0.01) for "adagrad", Adam(1e-3) otherwise."""
    import keras

    return keras.optimizers.Adagrad(0.01) if kind == "adagrad" else keras.optimizers.Adam(1e-3)
