"""Train a protein language model: python scripts/train.py [model=...] [data=...] [objective=...] (--help: the keys)"""
import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from protein_performer.errors import cli
from protein_performer.run_folder import discard_on_user_error
from protein_performer.training import train


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    with discard_on_user_error(hc.runtime.output_dir, hc.job.name, stop_at=hc.runtime.cwd):
        train(cfg, hc.runtime.output_dir)


if __name__ == "__main__":
    main()
