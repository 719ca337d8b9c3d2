"""protein-performer."""


def __getattr__(name):
    # Lazy, so that importing the package stays cheap: ``protein_performer.embed(...)``
    # imports torch and the model only when first used (the embed module is callable).
    if name == "embed":
        import importlib
        return importlib.import_module(".embed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
