"""Train a protein language model: python scripts/train.py [model=...] [data=...] [objective=...] (--help: the keys)
Same as `protein-performer train ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("train", prog="python scripts/train.py")
