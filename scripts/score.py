"""Score mutants zero-shot: python scripts/score.py ckpt=PATH input=assay.csv sequence=WT output=scored.csv (--help: every key)
Same as `protein-performer score ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("score", prog="python scripts/score.py")
