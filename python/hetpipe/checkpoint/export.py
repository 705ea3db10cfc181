"""``hetpipe export``: a checkpoint's global weights under the model's own names, torch-free.

The PS parts hold each layer's global weights (``w/<layer>``) and synced buffers (``b/<layer>``) as
flat float32 vectors; VW 0's stage parts hold the buffers the PS does not sync (``buf/<layer>.<name>``,
e.g. ``num_batches_tracked``). The manifest's ``names`` (:mod:`hetpipe.model.names`) gives, per layer
and in flat order, each tensor's shape and ``state_dict`` keys, so the export is the ``state_dict`` of
the model the layers came from: a ``.safetensors`` file ``model.load_state_dict`` takes (strict), or,
for a Hugging Face model, a folder ``from_pretrained`` opens (the weights and the model's config).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hetpipe.checkpoint.format import CheckpointError, find, read_manifest


def _read_parts(path: Path, manifest: Dict[str, Any]) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """(global tensors ``w/``, ``b/`` of every part, local buffers ``buf/`` of VW 0's stages)."""
    from safetensors.numpy import load_file

    shared, local = {}, {}
    for name in manifest["parts"]:
        part = json.loads((path / f"{name}.json").read_text())
        file = path / f"{name}.safetensors"
        try:
            tensors = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - any unreadable file is named
            raise CheckpointError(f"hetpipe export: cannot read {file}: {type(e).__name__}: {e}") from None
        for key, value in tensors.items():
            if key.startswith(("w/", "b/")):
                shared[key] = value
            elif key.startswith("buf/") and part.get("role") == "stage" and part.get("vw") == 0:
                local[key[4:]] = value
    return shared, local


def _split(flat: np.ndarray, entries: List[list], what: str) -> List[Tuple[list, np.ndarray]]:
    out, off = [], 0
    for entry in entries:
        n = int(np.prod(entry[3], dtype=np.int64))
        if off + n > flat.size:
            raise CheckpointError(f"hetpipe export: {what} holds {flat.size} values, fewer than its tensors' "
                                  f"shapes need (at {entry[1]!r}, shape {entry[3]})")
        out.append((entry, flat[off:off + n].reshape(entry[3])))
        off += n
    if off != flat.size:
        raise CheckpointError(f"hetpipe export: {what} holds {flat.size} values, its tensors {off}")
    return out


def state_dict(checkpoint: Path) -> Tuple[Dict[str, np.ndarray], Dict[str, Any], Path]:
    """The model's ``state_dict`` (numpy) from the latest complete checkpoint in ``checkpoint`` (or that
    checkpoint), the manifest's model description, and the checkpoint's path."""
    path = find(Path(checkpoint))
    manifest = read_manifest(path)
    names = manifest.get("names")
    if not names:
        raise CheckpointError(f"hetpipe export: {path} was written without the model's names (an older "
                              "hetpipe): resume it once with this version to get a checkpoint that has them")
    shared, local = _read_parts(path, manifest)
    out: Dict[str, np.ndarray] = {}
    layers = sorted({e[0] for e in names["params"]} | {e[0] for e in names["buffers"]})
    for l in layers:
        params = [e for e in names["params"] if e[0] == l]
        synced = [e for e in names["buffers"] if e[0] == l and e[4]]
        if params:
            if f"w/{l}" not in shared:
                raise CheckpointError(f"hetpipe export: {path} holds no weights of layer {l}")
            for entry, value in _split(shared[f"w/{l}"], params, f"the weights of layer {l}"):
                out.update({key: value.copy() for key in entry[2]})
        if synced and f"b/{l}" in shared:
            for entry, value in _split(shared[f"b/{l}"], synced, f"the synced buffers of layer {l}"):
                out.update({key: value.copy() for key in entry[2]})
        for entry in (e for e in names["buffers"] if e[0] == l and not e[4]):
            value = local.get(f"{l}.{entry[1]}")
            if value is not None:
                out.update({key: value.reshape(entry[3]).copy() for key in entry[2]})
    return out, names.get("model", {}), path


def export(checkpoint: Path, out: Optional[Path] = None, hf_dir: Optional[Path] = None) -> str:
    """Write the checkpoint's weights to ``out`` (safetensors) and/or a Hugging Face folder ``hf_dir``
    (``model.safetensors`` and ``config.json``); returns what was written, in one line."""
    from safetensors.numpy import save_file

    if out is None and hf_dir is None:
        raise CheckpointError("hetpipe export: give -o FILE.safetensors and/or --hf DIR")
    tensors, model, path = state_dict(checkpoint)
    written = []
    nbytes = sum(v.nbytes for v in tensors.values())
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out), metadata={"format": "pt"})
        written.append(str(out))
    if hf_dir is not None:
        config = model.get("config")
        if config is None:
            raise CheckpointError(f"hetpipe export: {path} is of a {model.get('class', 'model')} without a Hugging "
                                  "Face config: --hf needs a model adapted from a transformers model")
        hf = Path(hf_dir)
        hf.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
        (hf / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append(f"{hf}/ (model.safetensors, config.json)")
    return (f"hetpipe export: {len(tensors)} tensors ({nbytes} bytes) of the {model.get('class', 'model')} at clock "
            f"{read_manifest(path)['clock']} of {path} -> {', '.join(written)}")
