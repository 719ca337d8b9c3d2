"""Deliberate breakages (issue 11) that the suite must catch: each is applied, the tests run, the
file restored. `python tests/mutations.py tests/test_one_way.py tests/test_evaluate.py tests/test_objectives.py`
prints caught / NOT CAUGHT per breakage and exits 1 if any goes unnoticed."""
import pathlib, subprocess, sys
BREAKS = {
 "evaluate/validation clm: targets not shifted": ("protein_performer/objectives.py",
    "    inputs, labels = t[:-1], t[1:].clone()\n", "    inputs, labels = t[:-1], t[:-1].clone()\n"),
 "validation perplexity as exp of the mean of per-batch means": ("protein_performer/training/task.py",
    "        for k, v in rows.items():\n            self.val_sums[k].update(v.sum())\n",
    "        for k, v in rows.items():\n            self.val_sums[k].update(v.sum() / rows['count'].sum() if k != 'count' else torch.ones((), dtype=torch.float64))\n"),
 "validation baseline uniform 1/20": ("protein_performer/training/task.py",
    "        freqs = self.aa_frequencies\n",
    "        freqs = self.aa_frequencies\n        if freqs is not None:\n            freqs = torch.zeros_like(freqs)\n            freqs[self.tokenizer.standard_aa_ids] = 1 / 20\n"),
 "frequencies from train+valid (in memory)": ("protein_performer/data/datamodule.py",
    "amino_acid_frequencies(train, self.tokenizer)", "amino_acid_frequencies(train + valid, self.tokenizer)"),
 "frequencies from train+valid (shards)": ("protein_performer/data/prepare.py",
    '            if s == "train":\n                tc = np.bincount', '            if s in ("train", "valid"):\n                tc = np.bincount'),
 "data=sample split by a hash of the sequence": ("protein_performer/data/datamodule.py",
    "split = split_of(rec.id,", "split = split_of(rec.sequence,"),
 "random crop never draws the last window": ("protein_performer/data/datasets.py",
    "torch.randint(0, n - max_len + 1, ())", "torch.randint(0, n - max_len, ())"),
 "shard sampler counts validation batches": ("protein_performer/data/shard_datamodule.py",
    "self.trainer is not None and self.trainer.training and", "self.trainer is not None and"),
}
ok = True
for name, (f, old, new) in BREAKS.items():
    p = pathlib.Path(f); text = p.read_text()
    assert text.count(old) == 1, (name, f)
    p.write_text(text.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *sys.argv[1:]],
                           capture_output=True, text=True)
    finally:
        p.write_text(text)
    failed = [l for l in r.stdout.splitlines() if l.startswith("FAILED")]
    print(f"{'caught' if r.returncode else 'NOT CAUGHT'}: {name}: {failed[:1]}", flush=True)
    ok &= r.returncode != 0
sys.exit(0 if ok else 1)
