"""Performer kernels against exact softmax at equal steps: python scripts/compare.py [train.trainer.max_steps=...];
at equal wall-clock time with long crops: python scripts/compare.py --config-name long_proteins.
The report goes to output_dir/comparison.md; doc=docs/comparison.md rewrites the tracked one.
Same as `protein-performer compare ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("compare", prog="python scripts/compare.py")
