"""Linear probe on embeddings: python scripts/probe.py embeddings=OUT.h5 labels=labels.csv"""
import json
import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from protein_performer.probe import format_result, run_probe
from protein_performer.errors import cli


@hydra.main(config_path="../conf", config_name="probe", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    kw = OmegaConf.to_container(cfg, resolve=True)
    output = kw.pop("output")
    result = run_probe(kw.pop("embeddings"), kw.pop("labels"), **kw)
    print(format_result(result))
    text = json.dumps(result, indent=2)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")
        print(f"results: {output}")
    else:
        print(text)


if __name__ == "__main__":
    main()
