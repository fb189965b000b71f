"""A batch's columns as the tensors a training loop expects, each field by its kind.

The wire carries two shapes of column (``protocol.decode_batch``): fixed-shape arrays and
variable-length bytes. Fixed ones become tensors viewing the received frames (or the
shared-memory slot), whatever their kind: numbers, validity masks (``<field>.valid``, bool),
timestamps (integer units) and dictionary codes. Variable ones depend on the field's kind:

* ``binary`` / ``string``: a list of ``bytes`` / ``str``;
* a list of numbers (kind ``list``), as the trainer chose (``LoaderdDataset(lists=...)``):
  ``"offsets"`` gives ``batch[name]``, all the batch's elements in one tensor viewing the
  frame (no copy), and ``batch[name + ".offsets"]``, int64 ``[B + 1]``: sample i is
  ``values[offsets[i]:offsets[i + 1]]``; ``"padded"`` gives ``batch[name]``, ``[B, longest,
  *shape]`` with zeros after each sample's end (one copy), and ``batch[name + ".lengths"]``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from loaderd.client.protocol import BatchArrays, FieldSpec, VarColumn

LIST_LAYOUTS = ("offsets", "padded")


def check_lists(lists: str) -> str:
    """Validate ``lists=`` of a dataset.

    Raises:
        ValueError: not one of ``LIST_LAYOUTS``.
    """
    if lists not in LIST_LAYOUTS:
        raise ValueError(f"`lists` must be one of {LIST_LAYOUTS}, got {lists!r}")
    return lists


def to_torch(
    arrays: BatchArrays,
    schema: Sequence[FieldSpec],
    lists: str = "offsets",
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A decoded batch as a dict of tensors (and lists, for bytes and strings).

    Args:
        arrays: the decoded batch; its arrays may view received frames or a ring slot.
        schema: the daemon's fields, in wire order.
        lists: ``"offsets"`` or ``"padded"``: how a list field is delivered (module doc).
        into: the (empty) dict to fill, e.g. one of a dict subclass; a new dict by default.
    """
    batch: dict[str, Any] = {} if into is None else into
    if _writable(arrays):  # a ring slot: torch has nothing to warn about
        _fill(batch, arrays, schema, lists)
        return batch
    with warnings.catch_warnings():
        # The arrays view the received frames, which numpy marks read-only.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        _fill(batch, arrays, schema, lists)
    return batch


def _writable(arrays: BatchArrays) -> bool:
    """Whether every array of the batch is writable (``torch.from_numpy`` warns otherwise)."""
    if not (arrays.ids.flags.writeable and arrays.weights.flags.writeable):
        return False
    for col in arrays.columns.values():
        if isinstance(col, VarColumn):
            if col.data.readonly or not col.offsets.flags.writeable:
                return False
        elif not col.flags.writeable:
            return False
    return True


def _fill(
    batch: dict[str, Any], arrays: BatchArrays, schema: Sequence[FieldSpec], lists: str
) -> None:
    batch["id"] = torch.from_numpy(arrays.ids)
    batch["weight"] = torch.from_numpy(arrays.weights)
    for spec in schema:
        col = arrays.columns[spec.name]
        if not isinstance(col, VarColumn):
            batch[spec.name] = torch.from_numpy(col)
        elif spec.kind == "list":
            values, offsets = list_values(col, spec)
            if lists == "padded":
                padded, lengths = pad(values, offsets)
                batch[spec.name], batch[spec.name + ".lengths"] = padded, lengths
            else:
                batch[spec.name] = torch.from_numpy(values)
                batch[spec.name + ".offsets"] = torch.from_numpy(offsets)
        else:
            items = [bytes(col.item(i)) for i in range(len(col))]
            batch[spec.name] = [b.decode() for b in items] if spec.dtype == "string" else items


def list_values(col: VarColumn, spec: FieldSpec) -> tuple[np.ndarray, np.ndarray]:
    """A list field's elements (viewing the frame where aligned) and offsets in elements."""
    dtype = np.dtype(spec.dtype)
    elem_bytes = dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
    values = np.frombuffer(col.data, dtype)
    if values.ctypes.data % dtype.itemsize:  # a socket frame may start anywhere
        values = values.copy()
    return values.reshape(-1, *spec.shape), col.offsets // elem_bytes


def pad(values: np.ndarray, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``values[offsets[i]:offsets[i + 1]]`` as rows of one zero-padded tensor.

    Returns:
        ``(padded [B, longest, *shape], lengths int64 [B])``.
    """
    lengths = np.diff(offsets)
    n = len(lengths)
    longest = int(lengths.max()) if n else 0
    out = np.zeros((n, longest, *values.shape[1:]), values.dtype)
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(len(rows)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[rows, cols] = values[offsets[0] : offsets[-1]] if n else values[:0]
    return torch.from_numpy(out), torch.from_numpy(lengths)
