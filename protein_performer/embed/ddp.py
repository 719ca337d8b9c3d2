"""Several devices (``trainer.devices=N``): pass 2 through Lightning's predict loop under DDP,
one process per device.

Lightning starts the other processes by running the command again. Process 0 alone checks
the input, takes the outputs' locks and opens them, then hands every process the plan and
the opened outputs (a broadcast in ``setup``); each embeds its share of the batches and saves
them as one process would (journal batches keyed by protein, ``.pt`` files by id: no two
processes write one file). Errors (a NaN embedding, an input that changed) stop that
process's share and are gathered, so every process ends together; process 0 then raises the
first, or assembles the HDF5 file in input order."""
from __future__ import annotations

import warnings

import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, IterableDataset

from ..errors import UserError
from ..training.quiet import quiet_libraries
from .embedder import Embedder
from .plan import Work
from .settings import show

#: ``device`` -> Lightning's accelerator (settings.trainer_settings allows no single device here)
ACCELERATORS = {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}


class Writer(BasePredictionWriter):
    """Saves each finished batch into the outputs; at the end gathers every process's errors and counts."""

    def __init__(self):
        super().__init__("batch")
        self.gathered: list = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        try:
            pl_module.work.outputs.put(batch, prediction)
        except UserError as e:
            pl_module.errors.append((batch.number, str(e)))

    def on_predict_end(self, trainer, pl_module):
        out = pl_module.work.outputs
        self.gathered = [None] * trainer.world_size
        torch.distributed.all_gather_object(self.gathered, (pl_module.errors, out.embedded, out.residues))


class Share(IterableDataset):
    """This process's batches (read from the input as the loop asks for them); stops at an error."""

    def __init__(self, module: "EmbedModule"):
        self.module = module

    def __iter__(self):
        m = self.module
        try:
            for job in m.work.jobs(m.trainer.global_rank, m.trainer.world_size):
                if m.errors:
                    return
                yield job
        except UserError as e:
            m.errors.append((-1, str(e)))


def _as_is(job):
    return job


class EmbedModule(pl.LightningModule):
    """The embedder as Lightning's predict loop runs it; ``work`` comes from process 0."""

    def __init__(self, emb: Embedder, pad_id: int, work: Work | None):
        super().__init__()
        self.net = emb.model  # a submodule: Lightning moves it to this process's device
        self.emb, self.pad_id, self.work = emb, pad_id, work
        self.errors: list[tuple[int, str]] = []

    def setup(self, stage: str) -> None:
        self.work = self.trainer.strategy.broadcast(self.work, src=0)

    def predict_dataloader(self):
        return DataLoader(Share(self), batch_size=None, collate_fn=_as_is)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # token arrays: the embedder pads them and moves them

    def predict_step(self, job):
        return self.emb.forward(job.tokens, self.pad_id)


def make_trainer(settings: dict, device: str) -> pl.Trainer:
    """A Trainer for the predict loop alone: DDP, no logger, checkpoint, summary or bar of its own."""
    quiet_libraries()
    warnings.filterwarnings("ignore", message="Couldn't infer the batch indices")
    try:
        return pl.Trainer(accelerator=ACCELERATORS[str(device)], devices=settings["devices"],
                          num_nodes=settings["num_nodes"], strategy="ddp", precision="32-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          use_distributed_sampler=False, callbacks=[Writer()])
    except (MisconfigurationException, ValueError, RuntimeError) as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"trainer.devices={show(settings['devices'])} device={device}: {line}") from None


def embed_on_devices(trainer: pl.Trainer, emb: Embedder, pad_id: int, work: Work | None) -> tuple[int, int] | None:
    """Run every process's share (``work``: process 0's, None elsewhere); on process 0 the
    proteins and residues embedded by all, or the first error any of them met."""
    trainer.predict(EmbedModule(emb, pad_id, work), return_predictions=False)
    if trainer.global_rank != 0:
        return None
    gathered = next(c for c in trainer.callbacks if isinstance(c, Writer)).gathered
    errors = sorted(e for errs, _, _ in gathered for e in errs)
    if errors:
        raise UserError(errors[0][1])
    return sum(g[1] for g in gathered), sum(g[2] for g in gathered)
