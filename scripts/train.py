"""Train a protein language model: python scripts/train.py [model=...] [data=...] [objective=...]"""
import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from protein_performer.training import train
from protein_performer.errors import cli


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    train(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
