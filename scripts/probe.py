"""Linear probe on embeddings: python scripts/probe.py embeddings=OUT.h5 labels=labels.csv (--help: every key)"""
import json
import logging
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from protein_performer.errors import UserError, cli


@hydra.main(config_path="../conf", config_name="probe", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    for key in ("embeddings", "labels"):
        if OmegaConf.is_missing(cfg, key):
            raise UserError(f"{key} is required: python scripts/probe.py embeddings=OUT.h5 labels=labels.csv "
                            f"(--help lists every key)")
    from protein_performer.probe import format_result, run_probe  # after the checks: sklearn is slow to import
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    kw = OmegaConf.to_container(cfg, resolve=True)
    output = kw.pop("output")
    result = run_probe(kw.pop("embeddings"), kw.pop("labels"), **kw)
    print(format_result(result))
    text = json.dumps(result, indent=2)
    if output:
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, out)  # a results file that exists is whole
        print(f"results: {output}")
    else:
        print(text)


if __name__ == "__main__":
    main()
