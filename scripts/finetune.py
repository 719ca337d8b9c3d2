"""Fine-tune a supervised head: python scripts/finetune.py ckpt=PATH labels=labels.csv task=classification output_dir=DIR (--help: every key)
Same as `protein-performer finetune ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("finetune", prog="python scripts/finetune.py")
