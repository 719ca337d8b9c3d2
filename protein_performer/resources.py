"""Where the configs and the bundled data are, in a checkout and in an installed wheel alike.

The repository keeps them at the top level (``conf/``, ``data/``); the wheel ships them
inside the package (``protein_performer/conf``, ``protein_performer/bundled``, mapped in
pyproject.toml), so ``pip install protein-performer`` gives working commands run from any
directory. Configs name bundled files as ``${bundled:sample/swissprot_sample_20k.fasta.gz}``.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent


def _first_dir(*candidates: Path) -> Path:
    return next((p for p in candidates if p.is_dir()), candidates[-1])


def conf_dir() -> Path:
    """The Hydra config directory (train.yaml, evaluate.yaml, ... and the groups)."""
    return _first_dir(_PACKAGE / "conf", _CHECKOUT / "conf")


def bundled_dir() -> Path:
    """The bundled real proteins (sample/, heldout/, labeled/; provenance in its README.md)."""
    return _first_dir(_PACKAGE / "bundled", _CHECKOUT / "data")


def bundled(name: str) -> str:
    """Absolute path of a bundled file, e.g. ``bundled("sample/swissprot_sample_20k.fasta.gz")``."""
    return str(bundled_dir() / name)


if not OmegaConf.has_resolver("bundled"):
    OmegaConf.register_new_resolver("bundled", bundled)
