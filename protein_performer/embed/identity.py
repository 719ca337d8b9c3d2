"""What both output formats share: the identity that defines an output (a rerun resumes
only when all of it matches), the names proteins get in it, and the paths
beside an output (its journal, its lock)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

#: identity keys and how a refusal names them
IDENTITY = {"checkpoint_sha256": "checkpoint (weights sha256)", "model_config": "model config",
            "input_sha256": "input (file sha256)", "format": "format", "unknown": "unknown", "layers": "layers",
            "pooling": "pooling", "per_residue": "per_residue", "precision": "precision", "dim": "dim"}
#: the longest file name (bytes) of the usual file systems (ext4, xfs, btrfs, APFS, NTFS)
NAME_MAX = 255


def model_config(net: torch.nn.Module) -> str:
    """The settings that define the model (kernel, causal, sizes, ...) as canonical JSON. With
    the weights, what makes two loads "the same model": an exported directory whose config.json
    was edited loads the very same tensors into another model."""
    config = getattr(net, "config", None)
    return json.dumps(config.to_dict() if config is not None else {}, sort_keys=True)


def _plain(v):
    """HDF5 / JSON attribute -> comparable Python value."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode()
    return v.item() if isinstance(v, np.generic) else v


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def differences(old: dict, new: dict) -> str:
    """'' when ``old`` (what a file records) matches ``new``, else what differs, on one line."""
    def show(key, v):
        if v is None:
            return "none recorded"
        return f"{v[:12]}..." if key.endswith("sha256") else str(v)

    out = []
    for key, name in IDENTITY.items():
        a, b = _plain(old.get(key)), _plain(new[key])
        if a == b:
            continue
        try:  # the model config: name the settings that differ
            fa, fb = _flat(json.loads(a)), _flat(json.loads(b))
            out += [f"{name} {k} {fa.get(k)} (now {fb.get(k)})" for k in sorted(set(fa) | set(fb))
                    if fa.get(k) != fb.get(k)]
        except (TypeError, ValueError, AttributeError):
            out.append(f"{name} {show(key, a)} (now {show(key, b)})" if key != "model_config" else
                       f"{name} none recorded")
    return "; ".join(out)


def refuse(what: str, diff: str, path: Path):
    raise UserError(f"{what} was written with a different {diff}: write to a new output path, "
                    f"or pass overwrite=true to replace {path}")


def safe_name(record_id: str) -> str:
    """Id -> HDF5 member / file name: '%' and '/' percent-escaped, '.' and '..' too."""
    name = record_id.replace("%", "%25").replace("/", "%2F")
    return {".": "%2E", "..": "%2E%2E"}.get(name, name)


def check_name(entry, key: str, pt: bool) -> None:
    """Per-residue members and ``<id>.pt`` files are named by the id: refuse, naming the
    record, an id that cannot name one (before anything is written)."""
    if not entry.id:
        raise UserError(f"{entry.where}: record has an empty id, and {key} names each protein by its id: "
                        f"give it one (or drop the id column: ids are then derived from the sequences)")
    if pt:
        size = len(f"{safe_name(entry.id)}.pt".encode())
        if size > NAME_MAX:
            raise UserError(f"{entry.where}: record {entry.id[:40] + '...'!r}: its id makes a {size}-byte file "
                            f"name in pt_dir, over the {NAME_MAX}-byte limit; shorten it or use output=OUT.h5")


def lock_path(output: str | Path) -> Path:
    """The lock that gives ``output`` one writer at a time (beside it; removed when the run that
    created it ends)."""
    return Path(f"{output}.lock")


def journal_path(output: str | Path) -> Path:
    path = Path(output)
    return path.with_name(path.name + ".partial")
