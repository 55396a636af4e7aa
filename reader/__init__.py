"""The data pipeline: Parquet → CSR batches, key preparation, converters.

Import as ``wuliang.reader``. See ``docs/reader.md``.
"""

from wuliang.reader.batch import Csr, CsrBatch
from wuliang.reader.hashing import field_seed, hash_ints, hash_strings
from wuliang.reader.parquet import ParquetReader, ReaderPosition, ReaderStats, resolve_paths
from wuliang.reader.partitions import Partition, PartitionError, PartitionSource
from wuliang.reader.prepare import FeatureIndex, KeyPreparer, PreparedKeys, TableKeys
from wuliang.reader.stream import StreamPosition, StreamReader, ends_partition

__all__ = [
    "Csr",
    "CsrBatch",
    "FeatureIndex",
    "KeyPreparer",
    "ParquetReader",
    "Partition",
    "PartitionError",
    "PartitionSource",
    "PreparedKeys",
    "ReaderPosition",
    "ReaderStats",
    "StreamPosition",
    "StreamReader",
    "TableKeys",
    "ends_partition",
    "field_seed",
    "hash_ints",
    "hash_strings",
    "resolve_paths",
]
