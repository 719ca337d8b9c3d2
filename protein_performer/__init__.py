"""protein-performer."""
from . import resources  # noqa: F401  (registers the ${bundled:...} config resolver; cheap)

#: the names a notebook meets first -> the module that defines them
_LAZY = {"embed_sequences": "embed", "load_pretrained": "hub.load"}


def __getattr__(name):
    # Lazy, so that importing the package stays cheap: ``protein_performer.load_pretrained(...)``
    # imports torch and the model only when first used.
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
