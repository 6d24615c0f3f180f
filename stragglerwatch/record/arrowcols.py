"""Arrow arrays of Python values, built from numpy buffers.

``pyarrow.array`` on Python objects imports pandas when it is installed (to ask whether the input
is a pandas object): in a training process that is ~1 s of the log thread's CPU, under the
interpreter lock, at the first flush, and tens of MB on every rank. The writers of the training
process (step records, context and code samples) build their columns here instead, for the types
their schemas use: int32, int64, float64, bool, string, and lists of int32 or float64. ``None``
is a null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

_NUMERIC = {pa.int32(): np.int32, pa.int64(): np.int64, pa.float64(): np.float64}
_ZERO = {pa.int32(): 0, pa.int64(): 0, pa.float64(): 0.0, pa.bool_(): False, pa.string(): ""}


def _bits(flags: np.ndarray) -> pa.Buffer:
    return pa.py_buffer(np.packbits(flags, bitorder="little"))


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def column(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """The Arrow array of ``values`` of type ``type_`` (one of the types above)."""
    n = len(values)
    nulls = [v is None for v in values]
    validity = None
    if any(nulls):
        validity = _bits(~np.array(nulls, dtype=bool))
        if pa.types.is_list(type_):
            values = [[] if v is None else v for v in values]
        else:
            values = [_ZERO[type_] if v is None else v for v in values]
    if pa.types.is_list(type_):
        items = column([x for v in values for x in v], type_.value_type)
        offsets = pa.py_buffer(_offsets([len(v) for v in values]))
        return pa.Array.from_buffers(type_, n, [validity, offsets], children=[items])
    if type_ == pa.string():
        data = [str(v).encode() for v in values]
        offsets = pa.py_buffer(_offsets([len(b) for b in data]))
        return pa.Array.from_buffers(type_, n, [validity, offsets, pa.py_buffer(b"".join(data))])
    if type_ == pa.bool_():
        return pa.Array.from_buffers(type_, n, [validity, _bits(np.array(values, dtype=bool))])
    if type_ in _NUMERIC:
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(np.asarray(values, dtype=_NUMERIC[type_]))])
    raise TypeError(f"no column builder for {type_}")


def batch(columns: Sequence[Sequence[Any]], schema: pa.Schema) -> pa.RecordBatch:
    """A record batch of one value sequence per field of ``schema``."""
    return pa.RecordBatch.from_arrays([column(c, f.type) for c, f in zip(columns, schema, strict=True)],
                                      schema=schema)  # fmt: skip
