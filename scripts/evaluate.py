"""Evaluate checkpoints by protein length: python scripts/evaluate.py ckpt=PATH data.path=FILE output_dir=DIR
Same as `protein-performer evaluate ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("evaluate", prog="python scripts/evaluate.py")
