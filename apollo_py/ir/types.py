"""Tensor types: shapes and dtypes.

apollo_py's dtypes are named by strings everywhere in the IR so that types hash and print without
numpy: float32, float16, float64, the signed integers int8/16/32/64, the unsigned integers
uint8/16/32/64, and bool.  (ONNX's string, bfloat16, float8/float4, int4/uint4 and complex
types are not supported: numpy has no native dtype for most of them.)
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import ShapeError

DTYPES: dict[str, type] = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "bool": np.bool_,
}
FLOAT_DTYPES = frozenset({"float32", "float16", "float64"})
SIGNED_DTYPES = frozenset({"int8", "int16", "int32", "int64"})
UNSIGNED_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64"})
#: every integer dtype, signed and unsigned (bool is not an integer dtype here)
INT_DTYPES = SIGNED_DTYPES | UNSIGNED_DTYPES


def dtype_name(dtype) -> str:
    """Return apollo_py's name for a numpy dtype (or a name); ShapeError if unsupported."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ShapeError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return name


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype for an apollo_py dtype name."""
    return np.dtype(DTYPES[name])


@dataclass(frozen=True)
class TensorType:
    """A static tensor type: a shape of non-negative ints and a dtype name."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ShapeError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return np_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def np_dtype(self) -> np.dtype:
        return np_dtype(self.dtype)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype) -> "TensorType":
        return TensorType(self.shape, dtype)

    @staticmethod
    def of(array: np.ndarray) -> "TensorType":
        return TensorType(tuple(array.shape), dtype_name(array.dtype))

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"
