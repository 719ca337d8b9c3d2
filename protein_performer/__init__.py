"""protein-performer."""
from . import resources  # noqa: F401  (registers the ${bundled:...} config resolver; cheap)


def __getattr__(name):
    # Lazy, so that importing the package stays cheap: ``protein_performer.embed_sequences(...)``
    # imports torch and the model only when first used.
    if name == "embed_sequences":
        from .embed import embed_sequences
        return embed_sequences
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
