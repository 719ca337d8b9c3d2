"""Embed a FASTA / .dat / CSV file: python scripts/embed.py ckpt=PATH input=FILE output=OUT.h5 (--help: every key)
Same as `protein-performer embed ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("embed", prog="python scripts/embed.py")
