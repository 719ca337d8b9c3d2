"""Two CPU processes (gloo) under Lightning DDP over prepared shards: the ranks must see
disjoint data and end with identical weights. Run as a script by the test, the same way
``train.py trainer=ddp`` runs (Lightning re-launches the script for rank 1)."""
import gzip
import json
import os
import sys
from pathlib import Path

from conftest import ROOT
from forkserver import forks  # process 0 forked with its imports done; Lightning starts process 1



def main(data: str, cache: str, out: str) -> None:
    import pytorch_lightning as pl
    import torch

    from protein_performer.data.shard_datamodule import ShardDataModule
    from protein_performer.objectives import IGNORE
    from protein_performer.training.task import ProteinLM

    class Recording(ProteinLM):
        def training_step(self, batch, i):
            tokens = torch.where(batch["labels"] != IGNORE, batch["labels"], batch["inputs"])
            self.seen = getattr(self, "seen", []) + [" ".join(map(str, t[t != 0].tolist())) for t in tokens]
            return super().training_step(batch, i)

    pl.seed_everything(0)
    dm = ShardDataModule(path=data, data_dir=cache, max_len=64, max_tokens=512, valid_fraction=0.1,
                         test_fraction=0.0, prepare_workers=0, progress=False, mask_prob=0.15)
    model = Recording(model=dict(dim=16, depth=1, heads=2, ff_mult=2, dropout=0.0,
                                 attention=dict(kernel="softmax", nb_features=8)), lr=1e-2, warmup_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    def weights():
        return {k: v.tolist() for k, v in model.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}

    initial = weights()
    trainer.fit(model, datamodule=dm)
    Path(out, f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"seen": model.seen, "weights": weights(), "initial": initial}))


def test_two_ranks_see_different_data_and_end_identical(tmp_path):
    from protein_performer.formats.fasta import read_fasta
    data = tmp_path / "d.fasta.gz"
    with gzip.open(data, "wt") as f:
        for _, r in zip(range(300), read_fasta(ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz")):
            f.write(f">{r.id}\n{r.sequence}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = forks().run([sys.executable, __file__, str(data), str(tmp_path / "cache"), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["seen"]) > 0 and len(r1["seen"]) > 0
    assert not set(r0["seen"]) & set(r1["seen"])  # disjoint proteins
    assert r0["weights"].keys() == r1["weights"].keys()
    assert r0["weights"] == r1["weights"]  # gradients were all-reduced
    assert r0["weights"] != r0["initial"]  # and they did train


if __name__ == "__main__":
    main(*sys.argv[1:4])
