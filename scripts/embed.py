"""Embed a FASTA / .dat / CSV file: python scripts/embed.py ckpt=PATH input=FILE output=OUT.h5"""
import json
import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from protein_performer.embed import embed_file
from protein_performer.errors import cli


@hydra.main(config_path="../conf", config_name="embed", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    kw = OmegaConf.to_container(cfg, resolve=True)
    summary = embed_file(kw.pop("ckpt"), kw.pop("input"), **kw)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
