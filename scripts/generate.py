"""Sample proteins from a causal checkpoint in RNN mode.

python scripts/generate.py ckpt=PATH num_samples=N max_length=L temperature=T top_k=K top_p=P \
    prompt=MKT seed=S output=OUT.fasta
Same as `protein-performer generate ...` (after pip install)."""
from protein_performer.cli import run

if __name__ == "__main__":
    run("generate", prog="python scripts/generate.py")
