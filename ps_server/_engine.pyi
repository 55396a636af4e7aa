"""Type stubs of the C++ extension (bind_engine.cc). Use wuliang.ps_server."""

import enum

import numpy as np

class OptimizerKind(enum.Enum):
    SGD = ...
    ADAGRAD = ...
    ADAM = ...
    FTRL = ...

class InitKind(enum.Enum):
    NORMAL = ...
    TRUNCATED_NORMAL = ...
    UNIFORM = ...
    ZEROS = ...
    CONSTANT = ...

class NanPolicy(enum.Enum):
    DROP = ...
    RAISE = ...

class Precision(enum.Enum):
    FP32 = ...
    FP16 = ...
    INT8 = ...

class OptimizerSpec:
    kind: OptimizerKind
    learning_rate: float
    initial_accumulator: float
    epsilon: float
    beta1: float
    beta2: float
    beta: float
    l1: float
    l2: float
    clip_norm: float

class InitSpec:
    kind: InitKind
    mean: float
    stddev: float
    minval: float
    maxval: float
    value: float

class AdmissionSpec:
    min_count: int
    pending_capacity: int

class EvictionSpec:
    ttl_steps: int
    ttl_seconds: int
    min_count: int
    max_rows: int

class TableSpec:
    name: str
    dim: int
    optimizer: OptimizerSpec
    initializer: InitSpec
    seed: int
    admission: AdmissionSpec
    eviction: EvictionSpec
    nan_policy: NanPolicy
    reserve_rows: int
    precision: Precision
    stats_half_life: float

class UnknownTableError(KeyError): ...

class ExportCursor:
    @property
    def shard(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def done(self) -> bool: ...

class Engine:
    def __init__(
        self, num_shards: int, disk_dir: str = "", memory_bytes: int = 0, row_file_bytes: int = 0
    ) -> None: ...
    @property
    def num_shards(self) -> int: ...
    def worker_thread_ids(self) -> list[int]: ...
    step: int
    clock: int  # unix seconds stamped on rows and TTLs count back from; 0: the wall clock
    @property
    def version(self) -> int: ...
    def advance_version(self) -> int: ...
    def restore_version(self, version: int) -> None: ...
    def create_table(self, spec: TableSpec) -> int: ...
    def drop_table(self, name: str) -> None: ...
    def table_id(self, name: str) -> int: ...
    def spec(self, table: int) -> TableSpec: ...
    def table_names(self) -> list[str]: ...
    def pull(
        self,
        table: int,
        keys: np.ndarray,
        train: bool = True,
        out: np.ndarray | None = None,
        shard_offsets: np.ndarray | None = None,
    ) -> np.ndarray: ...
    def push(
        self,
        table: int,
        keys: np.ndarray,
        grads: np.ndarray,
        unique: bool = False,
        shard_offsets: np.ndarray | None = None,
        updated: np.ndarray | None = None,
        updated_rows: np.ndarray | None = None,
    ) -> dict[str, int]: ...
    def pull_many(
        self, parts: list[tuple], train: bool = True, step: int | None = None
    ) -> None: ...
    def prefetch_many(self, parts: list[tuple]) -> int: ...
    def push_many(
        self,
        # (table, keys, grads, shard_offsets, updated, updated_rows, shows, clicks)
        parts: list[tuple],
        unique: bool = False,
        only: int = 0,
        step: int | None = None,
    ) -> dict[str, int]: ...
    def erase(self, table: int, keys: np.ndarray) -> int: ...
    def contains(self, table: int, keys: np.ndarray) -> np.ndarray: ...
    def read_rows(
        self, table: int, keys: np.ndarray
    ) -> tuple[dict[str, np.ndarray], np.ndarray]: ...
    def evict(self, table: int, step: int | None = None) -> dict[str, int]: ...
    def evict_by_age(self, table: int, step: int | None = None) -> dict[str, int]: ...
    def count_histogram(self, table: int) -> np.ndarray: ...
    def steps_at_count(self, table: int, count: int) -> np.ndarray: ...
    def evict_least_frequent(
        self, table: int, threshold: int, cutoff: int, quota: int, step: int | None = None
    ) -> dict[str, int]: ...
    def stats(self, table: int) -> dict[str, int]: ...
    def export_chunk(
        self, table: int, since: int, max_rows: int, cursor: ExportCursor
    ) -> dict[str, np.ndarray]: ...
    def removed_log(self, table: int, since: int) -> tuple[np.ndarray, np.ndarray]: ...
    def load_removed(
        self, table: int, keys: np.ndarray, versions: np.ndarray, floor: int
    ) -> None: ...
    def trim_removed(self, table: int, upto: int) -> None: ...
    def pending_counts(self, table: int) -> tuple[np.ndarray, np.ndarray]: ...
    def load_pending(self, table: int, keys: np.ndarray, counts: np.ndarray) -> None: ...
    def load(
        self,
        table: int,
        keys: np.ndarray,
        weights: np.ndarray,
        state: np.ndarray | None = None,
        counts: np.ndarray | None = None,
        steps: np.ndarray | None = None,
        times: np.ndarray | None = None,
        versions: np.ndarray | None = None,
        shows: np.ndarray | None = None,
        clicks: np.ndarray | None = None,
        step: int | None = None,
    ) -> None: ...

def state_dim(kind: OptimizerKind, dim: int) -> int: ...
def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray: ...
def server_of(keys: np.ndarray, num_servers: int) -> np.ndarray: ...

# The disk tier's parts (details/row_file.h, details/cold_index.h), measured.
def disk_random_reads(
    dir: str, file_bytes: int, read_bytes: int, depth: int, seconds: float
) -> tuple[float, bool]: ...
def row_file_reads(
    dir: str, record_bytes: int, records: int, reads: int, depth: int, batch: int
) -> tuple[float, bool, float]: ...
def cold_index_bytes_per_key(keys: int) -> float: ...
def set_io_uring(enabled: bool) -> bool: ...
def io_uring_available() -> bool: ...
def memory_random_reads(bytes: int, reads: int, ahead: int) -> float: ...

IO_URING_DEPTH: int

# The GPU hot cache's CPU twin (details/cache_twin.h): the index kernels of
# details/cache_index.h and the engine's push arithmetic on cached rows.
def cache_lookup(
    regions: tuple,
    index: tuple,
    keys: np.ndarray,
    region: np.ndarray,
    counts: np.ndarray | None,
    observe: bool,
    epoch: int,
    policy: int,
    weight: float,
    clock: float,
) -> np.ndarray: ...
def cache_score_misses(
    regions: tuple,
    index: tuple,
    keys: np.ndarray,
    region: np.ndarray,
    counts: np.ndarray | None,
    policy: int,
    weight: float,
) -> tuple[np.ndarray, np.ndarray]: ...
def cache_populate(
    regions: tuple,
    index: tuple,
    keys: np.ndarray,
    region: np.ndarray,
    sets: np.ndarray,
    scores: np.ndarray,
    allowed: np.ndarray,
    epoch: int,
    policy: int,
    clock: float,
    weight: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
def cache_apply(
    optimizer: OptimizerSpec,
    rows: tuple,
    slots: np.ndarray,
    grads: np.ndarray,
    add_shows: np.ndarray | None,
    add_clicks: np.ndarray | None,
    step: int,
    now: int,
    half_life: float,
) -> np.ndarray: ...
def cache_put(rows: tuple, slots: np.ndarray, values: tuple) -> None: ...
