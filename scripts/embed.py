"""Embed a FASTA / .dat / CSV file: python scripts/embed.py ckpt=PATH input=FILE output=OUT.h5 (--help: every key)"""
import json
import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from protein_performer.errors import UserError, cli


@hydra.main(config_path="../conf", config_name="embed", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    for key in ("ckpt", "input"):  # in this order, whatever order Hydra would report them
        if OmegaConf.is_missing(cfg, key):
            raise UserError(f"{key} is required: python scripts/embed.py ckpt=CHECKPOINT input=FILE output=OUT.h5 "
                            f"(--help lists every key)")
    from protein_performer.embed import embed_file  # after the checks: torch takes seconds to import
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    kw = OmegaConf.to_container(cfg, resolve=True)
    summary = embed_file(kw.pop("ckpt"), kw.pop("input"), **kw)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
