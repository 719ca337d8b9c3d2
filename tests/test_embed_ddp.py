"""``embed ... trainer.devices=2``: two CPU processes (gloo) under Lightning's DDP predict loop,
resuming a run a single process left half done, write the same files, bit for bit, as one
process embedding everything; the two processes embed disjoint batches. Run as a script by
the test, the way ``protein-performer embed`` runs (Lightning re-runs the command for rank 1)."""
import hashlib
import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, save_checkpoint
from forkserver import forks  # process 0 forked with its imports done; Lightning starts process 1

AA = "ACDEFGHIKLMNPQRSTVWY"
LOG = "EMBED_DDP_TEST_LOG"  # where each process records the proteins it embedded


def record_batches() -> None:
    """Each process appends a hash of every token array it embeds to ``$LOG/rank<R>.txt``."""
    from protein_performer.embed.embedder import Embedder
    forward = Embedder.forward
    rank = os.environ.get("LOCAL_RANK", "0")

    def recording(self, batch, pad_id):
        with open(Path(os.environ[LOG], f"rank{rank}.txt"), "a") as fh:
            fh.writelines(hashlib.sha1(t.tobytes()).hexdigest() + "\n" for t in batch)
        return forward(self, batch, pad_id)

    Embedder.forward = recording


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(folder) -> dict:
    """Every file below ``folder`` (hidden bookkeeping included) -> its sha256."""
    return {str(p.relative_to(folder)): sha(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_two_processes_resume_and_write_the_single_process_files(tmp_path, monkeypatch):
    from protein_performer.embed import embed_file
    from protein_performer.embed.embedder import Embedder
    from test_embed import assert_same_file, tiny

    rng = random.Random(5)
    recs = [(f"p{i:02d}", "".join(rng.choice(AA) for _ in range(rng.randint(15, 110)))) for i in range(30)]
    inp = tmp_path / "in.fasta"
    inp.write_text("".join(f">{r}\n{s}\n" for r, s in recs))
    ckpt = save_checkpoint(tiny(), tmp_path / "tiny.ckpt")
    settings = dict(layers=[0, -1], pooling=["mean", "max"], per_residue=True, max_tokens=600, sort_records=12,
                    progress=False)
    clean, work = tmp_path / "clean", tmp_path / "work"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each DDP process runs (same kernels, same sums)
    try:
        assert embed_file(ckpt, inp, clean / "e.h5", clean / "pt", **settings)["embedded"] == 30
        calls = {"n": 0}
        forward = Embedder.forward

        def dying(self, batch, pad_id):  # one process embeds two batches, then is interrupted
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return forward(self, batch, pad_id)

        monkeypatch.setattr(Embedder, "forward", dying)
        with pytest.raises(KeyboardInterrupt):
            embed_file(ckpt, inp, work / "e.h5", work / "pt", **settings)
        monkeypatch.undo()
    finally:
        torch.set_num_threads(threads)
    before = {p.stem for p in (work / "pt").glob("*.pt")}
    saved = len(before)
    assert 0 < saved < 30

    log = tmp_path / "log"
    log.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled", **{LOG: str(log)})
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    args = [f"ckpt={ckpt}", f"input={inp}", f"output={work / 'e.h5'}", f"pt_dir={work / 'pt'}", "layers=[0,-1]",
            "pooling=[mean,max]", "per_residue=true", "max_tokens=600", "sort_records=12", "progress=false",
            "device=cpu", "trainer.devices=2"]
    proc = forks().run([sys.executable, __file__, "embed", *args], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # printed by process 0 alone
    assert summaries[0]["embedded"] == 30 - saved and summaries[0]["already_done"] == saved

    # the two processes embedded disjoint batches, together exactly what was missing
    from protein_performer.tokenizer import Tokenizer
    seen = [(log / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    missing = {hashlib.sha1(Tokenizer().encode(s).tobytes()).hexdigest() for r, s in recs if r not in before}
    assert missing <= set(seen[0]) | set(seen[1])

    # the same files as one process embedding everything, byte for byte
    assert_same_file(work / "e.h5", clean / "e.h5")
    assert sha(work / "e.h5") == sha(clean / "e.h5")
    assert listing(work / "pt") == listing(clean / "pt")
    assert sorted(p.name for p in work.iterdir()) == ["e.h5", "pt"]  # no journal, no lock left


if __name__ == "__main__":
    record_batches()
    from protein_performer.cli import main
    main(sys.argv[1:])
