"""Converters of public and custom data sets to the Parquet columns the reader reads.

Import as ``wuliang.reader.convert``; the command line is ``wuliang convert``.

* ``convert_criteo``: Criteo Display Advertising TSV (``criteo``);
* ``convert_movielens``: MovieLens CSVs, one file per day in time order
  (``movielens``);
* ``convert_csv``: any delimited file described by a YAML schema (``csv``).

Each writes its files atomically (``wuliang.reader.io.write_parquet``) into an
output directory it creates; a re-run overwrites the files of the last one.
"""

from wuliang.reader.convert.criteo import convert_criteo
from wuliang.reader.convert.csv import ColumnSpec, CsvSchema, convert_csv, load_schema
from wuliang.reader.convert.movielens import convert_movielens

__all__ = [
    "ColumnSpec",
    "CsvSchema",
    "convert_criteo",
    "convert_csv",
    "convert_movielens",
    "load_schema",
]
