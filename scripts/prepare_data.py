"""Download and prepare a data set into token shards: python scripts/prepare_data.py data=trembl (--help: the keys)
Same as `protein-performer prepare ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("prepare", prog="python scripts/prepare_data.py")
