"""The exact JSON of a ``state_dict``: what JSON holds as itself, the rest tagged, nothing pickled.

:func:`encode` maps a value to JSON that :func:`decode` maps back to an equal value of the same
types: ``None``, bools, ints, floats (inf and nan too: the checkpoint's JSON is written with
``allow_nan``), strings and lists as themselves; a dict whose keys are all strings as a JSON object;
the rest as an object under the reserved key ``"__hetpipe__"``::

    {"__hetpipe__": "tuple", "items": [...]}
    {"__hetpipe__": "dict", "items": [[key, value], ...]}      # non-string keys, or the reserved key
    {"__hetpipe__": "tensor", "dtype": "float32", "shape": [2, 3], "bytes": "<base64>"}

A tensor keeps its dtype, shape and bytes (it comes back on the CPU; :func:`merge` moves it to the
device of the tensor it replaces). A callable held as a dict value is code, not state: it is left out,
and :func:`merge` keeps the one the factory built again. Anything else is refused: one
:class:`~hetpipe.checkpoint.format.CheckpointError` naming the key path and the type.
"""

from __future__ import annotations

import base64
from typing import Any, Dict

import torch

from hetpipe.checkpoint.format import CheckpointError

TAG = "__hetpipe__"
HOLDS = "None, bools, ints, floats, strings, lists, tuples, dicts and tensors"


def encode(value: Any, what: str, path: str = "") -> Any:
    """The JSON of ``value``; ``what`` names it in the error raised for what it cannot hold (followed
    by the key path within ``value``, e.g. ``['lr_lambdas'][0]['table']``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, what, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, what, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        kept = {k: v for k, v in value.items() if not callable(v)}
        if all(isinstance(k, str) for k in kept) and TAG not in kept:
            return {k: encode(v, what, f"{path}[{k!r}]") for k, v in kept.items()}
        return {TAG: "dict", "items": [[encode(k, what, f"{path} (a key)"), encode(v, what, f"{path}[{k!r}]")]
                                       for k, v in kept.items()]}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value)
    kind = type(value).__qualname__ if type(value).__module__ == "builtins" else \
        f"{type(value).__module__}.{type(value).__qualname__}"
    raise CheckpointError(f"hetpipe: {what}{path} is a {kind}, which a checkpoint cannot hold (it holds {HOLDS})")


def decode(value: Any) -> Any:
    """The value :func:`encode` made ``value`` of (JSON written before the tags decodes as itself)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {k: decode(v) for k, v in value.items()}
    kind = value[TAG]
    if kind == "tuple":
        return tuple(decode(v) for v in value["items"])
    if kind == "dict":
        return {decode(k): decode(v) for k, v in value["items"]}
    if kind == "tensor":
        return _decode_tensor(value)
    raise CheckpointError(f"hetpipe: a checkpoint's state holds a value tagged {kind!r}, which this hetpipe does not "
                          "read (written by a newer one?)")


def merge(fresh: Any, saved: Any) -> Any:
    """``saved`` (a decoded state) over ``fresh`` (the state of the object built again): dicts merge key by
    key (keys :func:`encode` left out keep ``fresh``'s values), lists of the same length item by item, a
    tensor goes to the device of the tensor it replaces; anything else is ``saved``'s."""
    if isinstance(fresh, dict) and isinstance(saved, dict):
        return {**fresh, **{k: merge(fresh.get(k), v) for k, v in saved.items()}}
    if isinstance(fresh, list) and isinstance(saved, list) and len(fresh) == len(saved):
        return [merge(f, s) for f, s in zip(fresh, saved)]
    if isinstance(fresh, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(fresh.device)
    return saved


def _encode_tensor(t: torch.Tensor) -> Dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "bytes": base64.b64encode(raw).decode("ascii")}


def _decode_tensor(value: Dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(value["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"hetpipe: a checkpoint's state holds a tensor of dtype {value['dtype']!r}, which torch "
                              "does not know")
    raw = base64.b64decode(value["bytes"])
    if not raw:
        return torch.empty(value["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(value["shape"]).clone()
