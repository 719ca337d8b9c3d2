"""Sample proteins from a causal checkpoint in RNN mode.

python scripts/generate.py ckpt=PATH num_samples=N max_length=L temperature=T top_k=K top_p=P \
    prompt=MKT seed=S output=OUT.fasta
"""
import hydra
from omegaconf import DictConfig

from protein_performer.generate import run
from protein_performer.errors import cli


@hydra.main(config_path="../conf", config_name="generate", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(ckpt=cfg.ckpt, output=cfg.output, num_samples=int(cfg.num_samples), max_length=int(cfg.max_length),
        min_length=int(cfg.min_length), temperature=float(cfg.temperature), top_k=int(cfg.top_k),
        top_p=float(cfg.top_p), prompt=None if cfg.prompt is None else str(cfg.prompt),
        seed=None if cfg.seed is None else int(cfg.seed),
        batch_size=None if cfg.batch_size is None else int(cfg.batch_size), device=cfg.device)


if __name__ == "__main__":
    main()
