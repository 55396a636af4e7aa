"""The on-disk version format: checkpoints, exports and serving read and
write versions only through this package, and a parameter-server process
writes its part of one without the trainer's package.

A *version* is a directory::

    <root>/<name>/
        manifest.json                     what is here (``manifest.Manifest``),
                                          with a sha256 per file
        tables/<table>/part-00000.arrow   rows (``rows``: Arrow IPC, uncompressed)
        tables/<table>/removed.arrow      removal records: key, version
        tables/<table>/pending.arrow      admission counts (checkpoints): key, count
        dense/..., serving/...            TF checkpoint, SavedModel files

Parts hold at most ``PART_ROWS`` rows; the part files are independent of the
engine's shard count, so a version restores into any number of shards (or
servers). Writes are atomic and reads check every file once
(``version``). ``<root>`` may be a local folder or a URI of an object store
(``s3://bucket/prefix``), where the manifest, uploaded last, commits a
version. Modules:

* ``manifest``: the typed manifest (tables with their whole ``TableSpec``,
  the model's description, files), format 1 still read;
* ``rows``: rows files to and from ``RowChunk``;
* ``version``: ``VersionWriter`` and ``Version``;
* ``directories``: a model directory's checkpoints, an export directory's
  versions and chains;
* ``location``: local paths and URIs (``RemotePath``);
* ``crash``: test-only crash points inside the writers.
"""

from wuliang.ps_server.storage.crash import crash_point
from wuliang.ps_server.storage.directories import (
    CHECKPOINT_PREFIX,
    LATEST,
    chain,
    checkpoints,
    latest,
    latest_checkpoint,
    uncommitted_checkpoints,
    versions,
)
from wuliang.ps_server.storage.location import Location, RemotePath, is_uri, location
from wuliang.ps_server.storage.manifest import (
    FORMAT,
    SIGNATURE,
    CorruptVersionError,
    DenseInput,
    FileEntry,
    Manifest,
    ModelDescription,
    SparseInput,
    TableEntry,
)
from wuliang.ps_server.storage.rows import read_part, select_rows
from wuliang.ps_server.storage.version import (
    MANIFEST,
    PART_ROWS,
    SERVING,
    TMP_PREFIX,
    Version,
    VersionWriter,
    remove_stale_temporaries,
    remove_version,
    write_json_atomic,
)

__all__ = [
    "CHECKPOINT_PREFIX",
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "PART_ROWS",
    "SERVING",
    "SIGNATURE",
    "TMP_PREFIX",
    "CorruptVersionError",
    "DenseInput",
    "FileEntry",
    "Location",
    "Manifest",
    "ModelDescription",
    "RemotePath",
    "SparseInput",
    "TableEntry",
    "Version",
    "VersionWriter",
    "chain",
    "checkpoints",
    "crash_point",
    "is_uri",
    "latest",
    "latest_checkpoint",
    "location",
    "read_part",
    "remove_stale_temporaries",
    "remove_version",
    "select_rows",
    "uncommitted_checkpoints",
    "versions",
    "write_json_atomic",
]
