"""Convert ESM-2 to an exported protein-performer directory: python scripts/convert_esm.py input=ESM output=DIR
Same as `protein-performer convert-esm ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("convert-esm", prog="python scripts/convert_esm.py")
