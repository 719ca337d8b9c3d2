"""Export a checkpoint as a shareable directory: python scripts/export.py ckpt=PATH output=DIR [metrics=FILE]"""
import hydra
from omegaconf import DictConfig

from protein_performer.errors import cli
from protein_performer.pretrained import export


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    out = export(cfg.ckpt, cfg.output, metrics=cfg.metrics, overwrite=bool(cfg.overwrite))
    print(f"wrote {out}: config.json, model.safetensors, vocab.txt, transformers code, README.md (model card)")


if __name__ == "__main__":
    main()
