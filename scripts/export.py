"""Export a checkpoint as a shareable directory: python scripts/export.py ckpt=PATH output=DIR [metrics=FILE]
Same as `protein-performer export ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("export", prog="python scripts/export.py")
