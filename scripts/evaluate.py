"""Evaluate checkpoints by protein length: python scripts/evaluate.py ckpt=PATH data.path=FILE output_dir=DIR"""
import hydra
from omegaconf import DictConfig, OmegaConf

from protein_performer.evaluate import evaluate, format_table
from protein_performer.errors import cli


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    ckpt = OmegaConf.to_container(cfg.ckpt) if OmegaConf.is_list(cfg.ckpt) else cfg.ckpt
    results = evaluate(ckpt, cfg.data.path, cfg.output_dir, names=cfg.names, fmt=cfg.data.format,
                       max_records=cfg.data.max_records, unknown=cfg.data.unknown,
                       on_invalid=cfg.data.on_invalid, seed=cfg.seed, mask_prob=cfg.mask_prob,
                       max_tokens=cfg.max_tokens, batch_size=cfg.batch_size, window=cfg.window,
                       stride=cfg.stride, device=cfg.device, progress=cfg.progress)
    print(format_table(results))
    print(f"\nwrote {cfg.output_dir}/metrics.json, metrics.csv, metrics.png")


if __name__ == "__main__":
    main()
