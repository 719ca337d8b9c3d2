"""Performer kernels against exact softmax at equal steps: python scripts/compare.py [train.trainer.max_steps=...];
at equal wall-clock time with long crops: python scripts/compare.py --config-name long_proteins.
The report goes to output_dir/comparison.md; doc=docs/comparison.md rewrites the tracked one."""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from protein_performer.compare import compare, flatten_overrides, perplexity_gaps
from protein_performer.evaluate import format_table
from protein_performer.errors import cli


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    overrides = flatten_overrides(OmegaConf.to_container(cfg.train, resolve=True))
    command = "python scripts/compare.py " + " ".join(sys.argv[1:])
    doc = cfg.doc or Path(cfg.output_dir) / "comparison.md"  # tracked docs only when asked
    results = compare(list(cfg.models), overrides, cfg.heldout.path, cfg.output_dir, doc=doc,
                      reuse=cfg.reuse, command=command.strip(), exact_name=cfg.exact,
                      model_overrides={name: flatten_overrides(tree) for name, tree in
                                       OmegaConf.to_container(cfg.model_overrides, resolve=True).items()},
                      title=cfg.title,
                      max_records=cfg.heldout.max_records, **OmegaConf.to_container(cfg.eval, resolve=True))
    print(format_table(results))
    for name, gap in perplexity_gaps(results, cfg.exact).items():
        print(f"{name}: perplexity {100 * gap:+.2f} % against {cfg.exact}")
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
