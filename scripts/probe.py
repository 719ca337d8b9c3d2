"""Linear probe on embeddings: python scripts/probe.py embeddings=OUT.h5 labels=labels.csv (--help: every key)
Same as `protein-performer probe ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("probe", prog="python scripts/probe.py")
