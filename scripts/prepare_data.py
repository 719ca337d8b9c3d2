"""Download and prepare a data set into token shards: python scripts/prepare_data.py data=trembl (--help: the keys)"""
import hydra
from omegaconf import DictConfig

from protein_performer.data.shards import PreparedData
from protein_performer.errors import UserError, cli


@hydra.main(config_path="../conf", config_name="prepare_data", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    datamodule = hydra.utils.instantiate(cfg.data)
    if not hasattr(datamodule, "source_file"):
        raise UserError(f"data: {cfg.data._target_} reads its file in memory, there is nothing to prepare "
                        f"(use data=fasta or data=uniprot with data.path=FILE)")
    datamodule.prepare_data()
    m = PreparedData(datamodule._prepared_dir).manifest
    print(f"{m['records_read']:,} read = {m['kept']:,} kept + {m['duplicates']:,} duplicates + "
          f"{m['invalid']:,} invalid; {m['tokens']:,} tokens\nprepared data: {datamodule._prepared_dir}")


if __name__ == "__main__":
    main()
