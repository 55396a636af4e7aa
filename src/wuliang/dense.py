"""The tower shared by several trainers through the parameter servers.

When several trainers of a cluster train one model (``Context.shares_tower``),
the tower's variables live on the parameter servers, as in the seed system,
XDL and TensorFlow's classic parameter-server training, and the trainers
update them asynchronously:

* **layout.** The trainable variables, flattened in the training step's
  order and concatenated, are cut into blocks of ``BLOCK`` floats: block
  ``i`` is row ``i + 1`` of the table ``__tower__`` (dim ``BLOCK``; the last
  block zero-padded). The servers apply the optimizer to it: the tower's
  Keras optimizer mapped to the engine's (``engine_optimizer``: SGD,
  Adagrad, Adam, FTRL with the same hyper-parameters; anything else, or
  gradient clipping, weight decay or a learning-rate schedule, is refused
  naming it). Non-trainable variables (batch-norm statistics) are the rows
  of ``__tower_state__``, written by the chief after each of its steps and
  read by the other trainers: they follow the chief's.
* **a step.** Before computing, a trainer pulls the blocks and assigns them
  to its variables; after, it pushes the step's gradients (a variable the
  loss does not reach: zeros), which the servers apply.
* **every k steps** (``Context(tower_sync_steps=k)``, Paddle's GEO mode):
  each trainer applies its own Keras optimizer (any) for k steps, then
  pushes the change of its variables since its last sync and pulls the
  sum of everyone's: ``__tower__`` is then ``SGD(1.0)`` over the pushed
  negated deltas, i.e. the servers add them. The tower's traffic is k
  times smaller; its cost in AUC is measured in ``docs/cluster.md``.
* **start.** At its first step the chief, having restored (or not), fills
  the tables from its own variables when they are empty, and pulls them
  otherwise (the servers' rows are the newest); then it marks the job
  ready (``wuliang.job``), which the workers wait for before their first
  step. Checkpoints hold both tables (and the chief's variables as pulled
  last, for serving); a checkpoint of a single trainer restores into a
  cluster through the chief's variables, and one of a cluster into a
  single trainer through its ``dense/`` variables.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from wuliang.ps_server import ParameterServer, PullPart, PushPart
from wuliang.ps_server.spec import FTRL, SGD, Adagrad, Adam, Eviction, Optimizer, TableSpec, Zeros

__all__ = ["BLOCK", "STATE_TABLE", "TOWER_TABLE", "SharedTower", "engine_optimizer"]

log = logging.getLogger("wuliang")
TOWER_TABLE = "__tower__"
STATE_TABLE = "__tower_state__"
BLOCK = 256  # floats per row of the tower tables


def engine_optimizer(optimizer: Any) -> Optimizer:
    """The engine optimizer that applies ``optimizer`` (a Keras optimizer)
    on the parameter servers; ValueError naming what cannot be mapped."""
    name = type(optimizer).__name__
    config = optimizer.get_config()
    lr = config.get("learning_rate")
    if not isinstance(lr, int | float):
        raise ValueError(
            f"the tower's {name} has a learning-rate schedule ({lr!r}); with several "
            "trainers the parameter servers apply the tower's optimizer with a constant "
            "learning rate: pass a number"
        )
    for option in ("clipnorm", "clipvalue", "global_clipnorm"):
        if config.get(option):
            raise ValueError(
                f"the tower's {name} has {option}={config[option]}; with several trainers "
                "the parameter servers apply the optimizer, which clips nothing: remove it"
            )
    if config.get("weight_decay"):
        raise ValueError(
            f"the tower's {name} has weight_decay={config['weight_decay']}, which the "
            "parameter servers do not apply: remove it (or add a regularization loss)"
        )
    if config.get("use_ema"):
        raise ValueError(f"the tower's {name} uses an EMA, which the parameter servers do not keep")
    lr = _number(lr)
    if name == "SGD":
        if config.get("momentum") or config.get("nesterov"):
            raise ValueError(
                "the tower's SGD has momentum, which the parameter servers' SGD does not keep: "
                "use SGD without momentum, Adagrad, Adam or Ftrl"
            )
        return SGD(lr)
    if name == "Adagrad":
        return Adagrad(
            lr,
            initial_accumulator=_number(config.get("initial_accumulator_value", 0.1)),
            epsilon=_number(config.get("epsilon", 1e-7)),
        )
    if name == "Adam":
        if config.get("amsgrad"):
            raise ValueError("the tower's Adam has amsgrad=True, which the servers' Adam does not")
        return Adam(
            lr,
            beta1=_number(config.get("beta_1", 0.9)),
            beta2=_number(config.get("beta_2", 0.999)),
            epsilon=_number(config.get("epsilon", 1e-7)),
        )
    if name == "Ftrl":
        if config.get("learning_rate_power", -0.5) != -0.5 or config.get(
            "l2_shrinkage_regularization_strength"
        ):
            raise ValueError(
                "the tower's Ftrl has a learning_rate_power other than -0.5 or l2 shrinkage, "
                "which the parameter servers' FTRL does not"
            )
        return FTRL(
            lr,
            l1=_number(config.get("l1_regularization_strength", 0.0)),
            l2=2.0 * _number(config.get("l2_regularization_strength", 0.0)),
            beta=_number(config.get("beta", 0.0)) or 1.0,
            initial_accumulator=_number(config.get("initial_accumulator_value", 0.1)),
        )
    raise ValueError(
        f"the tower's optimizer {name} cannot be applied on the parameter servers; with "
        "several trainers use keras.optimizers.SGD (no momentum), Adagrad, Adam or Ftrl"
    )


def _number(value: Any) -> float:
    """A hyper-parameter as written (Keras keeps float32: 0.1 is 0.100000001)."""
    return float(str(np.float32(value)))


def tower_specs(optimizer: Any, sync_steps: int = 1) -> dict[str, TableSpec]:
    """The specs of the tower's two tables for a Keras optimizer (every step),
    or for deltas added every ``sync_steps`` > 1 steps."""
    never = Eviction()
    return {
        TOWER_TABLE: TableSpec(
            TOWER_TABLE,
            BLOCK,
            optimizer=engine_optimizer(optimizer) if sync_steps == 1 else SGD(1.0),
            initializer=Zeros(),
            eviction=never,
            nan_policy="drop",
        ),
        STATE_TABLE: TableSpec(
            STATE_TABLE, BLOCK, optimizer=SGD(1.0), initializer=Zeros(), eviction=never
        ),
    }


class _Blocks:
    """Variables flattened and cut into rows of BLOCK floats."""

    def __init__(self, variables: list[Any]) -> None:
        self.variables = variables
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        self.total = sum(self.sizes)
        self.rows = max(1, -(-self.total // BLOCK))
        self.keys = np.arange(1, self.rows + 1, dtype=np.uint64)

    def pack(self, arrays: list[Any]) -> np.ndarray:
        out = np.zeros((self.rows, BLOCK), np.float32)
        flat = out.reshape(-1)
        at = 0
        for size, value in zip(self.sizes, arrays, strict=True):
            flat[at : at + size] = np.asarray(value, np.float32).reshape(-1)
            at += size
        return out

    def assign(self, rows: np.ndarray) -> None:
        flat = rows.reshape(-1)
        at = 0
        for size, variable in zip(self.sizes, self.variables, strict=True):
            variable.assign(flat[at : at + size].reshape(variable.shape))
            at += size


class SharedTower:
    """The tower's variables on the parameter servers (see the module docstring).

    Args:
        ps: the parameter servers.
        trainable: the variables the training step updates, in its order.
        non_trainable: the tower's other variables (batch-norm statistics).
        is_chief: whether this trainer's non-trainable values are the job's.
        sync_steps: 1: the servers apply every step's gradients; k > 1: the
            trainer's optimizer applies them and the change is added to the
            servers' values every k steps.
    """

    def __init__(
        self,
        ps: ParameterServer,
        trainable: list[Any],
        non_trainable: list[Any],
        is_chief: bool,
        sync_steps: int = 1,
    ) -> None:
        self.ps = ps
        self.trainable = _Blocks(trainable)
        self.state = _Blocks(non_trainable) if non_trainable else None
        self.is_chief = is_chief
        self.sync_steps = sync_steps
        self._pulled = np.empty((self.trainable.rows, BLOCK), np.float32)
        self._base: np.ndarray | None = None  # the values of the last sync (k > 1)
        self._since = 0  # steps since then

    def before_step(self) -> None:
        """Every step's pull (k = 1); with k > 1 the variables are the trainer's."""
        if self.sync_steps == 1:
            self.pull()

    def after_step(self, grads: list[Any] | None, step: int) -> None:
        """A trained step: its gradients pushed (k = 1), or every k-th step
        the change since the last sync added and everyone's pulled."""
        if self.sync_steps == 1:
            if grads is not None:
                self.push(grads, step)
            return
        self._since += 1
        if self._since >= self.sync_steps:
            self.sync(step)

    def sync(self, step: int | None = None) -> None:
        """k > 1: pushes this trainer's change since the last sync (the
        servers add it) and takes the sum of everyone's."""
        current = self.trainable.pack([v.numpy() for v in self.trainable.variables])
        if self._base is not None:
            part = PushPart(TOWER_TABLE, self.trainable.keys, self._base - current)  # SGD(1): +Δ
            self.ps.push_many([part], unique=True, step=step)
        if self.is_chief:
            self.write_state()
        self._since = 0
        self._pull_values()

    def start(self) -> str:
        """The chief: fills the tables from its variables where they are
        empty, else takes theirs; returns which ("filled" or "pulled")."""
        present = self.ps.contains(TOWER_TABLE, self.trainable.keys)
        if present.all():
            self.pull()
            return "pulled"
        if present.any():
            raise RuntimeError(
                f"table {TOWER_TABLE} holds {int(present.sum())} of the tower's "
                f"{len(present)} blocks: it belongs to another model"
            )
        values = self.trainable.pack([v.numpy() for v in self.trainable.variables])
        self.ps.load(TOWER_TABLE, self.trainable.keys, values)
        self.write_state()
        if self.sync_steps > 1:
            self._base = values
        return "filled"

    def pull(self) -> None:
        """Assigns the servers' values to the variables (k > 1: after adding
        this trainer's change since its last sync)."""
        if self.sync_steps > 1 and self._base is not None:
            self.sync()
            return
        self._pull_values()

    def _pull_values(self) -> None:
        part = PullPart(TOWER_TABLE, self.trainable.keys, self._pulled)
        self.ps.pull_many([part], train=False)
        self.trainable.assign(self._pulled)
        if self.sync_steps > 1:
            self._base = self._pulled.copy()
        if self.state is not None and not self.is_chief:
            found = self.ps.lookup(STATE_TABLE, self.state.keys)
            if found.found.all():
                self.state.assign(found.rows)

    def push(self, grads: list[Any], step: int) -> None:
        """Pushes a step's gradients (None: zeros) to the servers; the chief
        also writes its non-trainable values."""
        arrays = [
            np.zeros(v.shape, np.float32) if g is None else g
            for g, v in zip(grads, self.trainable.variables, strict=True)
        ]
        part = PushPart(TOWER_TABLE, self.trainable.keys, self.trainable.pack(arrays))
        self.ps.push_many([part], unique=True, step=step)
        if self.is_chief:
            self.write_state()

    def write_state(self) -> None:
        if self.state is not None:
            values = self.state.pack([v.numpy() for v in self.state.variables])
            self.ps.load(STATE_TABLE, self.state.keys, values)
