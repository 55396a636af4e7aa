"""Where a training step's embedding rows and row gradients live.

A step's pulled rows (one ``[U + 1, dim]`` array per group of tables) go to
TensorFlow without a copy, and the gradients TensorFlow returns for the
looked-up values are summed into row gradients where they are:

* **host** (``RowMemory()``, the default): numpy arrays, 64-byte aligned,
  shared with TensorFlow on the CPU through DLPack (``bridge.as_tensor``);
  the sums by the C++ ``scatter_add_rows``.
* **device** (``RowMemory(kernels)`` with the GPU hot cache's cupy kernels,
  where TensorFlow has a GPU too): cupy arrays, filled by the cache's
  gathers on the device and handed to TensorFlow through DLPack (row-major,
  offset 0, the producer's stream synchronized first: TensorFlow takes no
  stream); TensorFlow's gradients come back through DLPack and are summed
  on the device in the order a sequential loop adds them, then pushed from
  the device. The host sees only the misses.

With the cache's numpy twin (no GPU) the memory is the host's, and the
same calls run on numpy arrays: what the tests on a CPU run end to end.
``RowMemory.for_server`` picks one for a parameter server.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from wuliang.embedding.kernels import scatter_add_rows

log = logging.getLogger("wuliang")
_TF_ALIGN = 64  # bytes: TensorFlow's tensor alignment (EIGEN_MAX_ALIGN_BYTES)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array that ``as_tensor`` shares with
    TensorFlow instead of copying (its data 64-byte aligned)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    buffer = np.empty(size + _TF_ALIGN, np.uint8)
    start = -buffer.ctypes.data % _TF_ALIGN
    return buffer[start : start + size].view(dtype).reshape(shape)


def as_tensor(value: Any) -> Any:
    """A step input as a tensor. A C-contiguous, 64-byte aligned, writeable
    numpy array is shared through DLPack (public API; no copy, where a
    conversion would copy every pulled row on the main thread); anything
    else is left to TensorFlow, which copies it. The caller must not write
    the array while the step runs."""
    if (
        isinstance(value, np.ndarray)
        and value.size
        and value.flags.c_contiguous
        and value.flags.writeable
        and value.ctypes.data % _TF_ALIGN == 0
    ):
        return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
    return value


def from_capsule(xp: Any, capsule: Any) -> Any:
    """A DLPack capsule (TensorFlow's ``to_dlpack``) as an array of ``xp``,
    without a copy."""
    try:
        return xp.from_dlpack(capsule)
    except TypeError:  # a cupy that takes only objects with __dlpack__
        return xp.fromDlpack(capsule)


def tensorflow_sees_a_gpu() -> bool:
    """Whether TensorFlow has a GPU to run the towers on."""
    return bool(tf.config.list_physical_devices("GPU"))


class RowMemory:
    """Rows and row gradients in host memory (``kernels`` None or numpy's)
    or in the GPU hot cache's device memory (its cupy kernels)."""

    def __init__(self, kernels: Any = None) -> None:
        self.kernels = kernels
        self.on_device = kernels is not None and kernels.name != "numpy"

    @staticmethod
    def for_server(ps: Any) -> RowMemory:
        """The memory a step's rows use with this parameter server: the
        device's when it is a GPU cache on cupy and TensorFlow has a GPU,
        else the host's (a cupy cache then copies rows to the host)."""
        kernels = getattr(ps, "kernels", None)
        if kernels is None:
            return RowMemory()
        if kernels.name != "numpy" and not tensorflow_sees_a_gpu():
            log.info("GPU cache: TensorFlow sees no GPU; a step's rows go through the host")
            return RowMemory()
        return RowMemory(kernels)

    @property
    def xp(self) -> Any:
        """The array module of this memory (cupy on the device, else numpy)."""
        return self.kernels.xp if self.on_device else np

    def empty(self, shape: tuple[int, ...]) -> Any:
        """float32 rows, uninitialised."""
        if self.on_device:
            return self.kernels.xp.empty(shape, np.float32)
        return aligned_empty(shape, np.float32)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        if self.on_device:
            return self.kernels.xp.zeros(shape, np.float32)
        return np.zeros(shape, np.float32)

    def to_tf(self, rows: Any) -> Any:
        """Rows as a tensor without a copy (DLPack)."""
        if not self.on_device:
            return as_tensor(rows)
        self.kernels.synchronize()  # TensorFlow reads on a stream of its own
        return tf.experimental.dlpack.from_dlpack(rows.__dlpack__())

    def from_tf(self, tensor: Any) -> Any:
        """A tensor TensorFlow returned, as an array here (no copy where the
        tensor is in this memory)."""
        if not self.on_device:
            return np.asarray(tensor)
        return from_capsule(self.kernels.xp, tf.experimental.dlpack.to_dlpack(tensor))

    def scatter_add_rows(self, out: Any, index: np.ndarray, values: Any) -> None:
        """``out[index[i]] += values[i]`` in order of i (deterministic sums)."""
        if self.on_device:
            self.kernels.scatter_add_rows(out, index, values)
        else:
            scatter_add_rows(out, index, np.asarray(values, np.float32))

    def finite_rows(self, values: Any) -> np.ndarray:
        """bool ``[n]`` on the host: rows whose values are all finite."""
        if self.on_device:
            return self.kernels.finite_rows(values)
        return np.isfinite(values).all(axis=1)
