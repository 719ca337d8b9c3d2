#!/usr/bin/env python
"""Build the fifth downstream task (issue 45, item 3): a protein's functional family, named from its
UniProt description, with whole names kept on one side of the split.

Why: the four bundled tasks tuned the fine-tuning recipe; an honest check of it needs a task it never
saw.  The labels come from real UniProtKB entries (the description before ``OS=``) in
../shared/data/train/uniprotkb_mix_20k.fasta.gz (UniProt data, CC BY 4.0, as packaged in Debian
``mmseqs2-examples``): a description naming exactly one of the families below gives the label; one
naming none or several is dropped, as are proteins over ``--max-length`` residues.  All proteins that
share a description (the same enzyme from many strains, e.g. "Threonine--tRNA ligase") go to one split,
so the test split asks for families of proteins whose names the training split never had.

    python data/labeled/scripts/family_task.py --input ../shared/data/train/uniprotkb_mix_20k.fasta.gz \\
        --output data/labeled/uniprot_family_names.csv.gz

Deterministic for a given input and seed.  Columns: id, sequence, label, split (train / valid / test).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import random
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

if __name__ == "__main__":  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[3])

#: label -> the description pattern that names it (case-insensitive)
FAMILIES = {
    "tRNA ligase": r"tRNA ligase|tRNA synthetase",
    "ribosomal protein": r"ribosomal protein",
    "ABC transporter": r"ATP-binding protein|ABC transporter",
    "kinase": r"kinase",
    "polymerase": r"polymerase",
    "oxidoreductase": r"dehydrogenase|reductase|oxidase",
    "methyltransferase": r"methyltransferase",
    "synthase": r"synthase",
    "chaperone": r"chaperon|heat shock",
    "transcription regulator": r"transcription",
    "peptidase": r"protease|peptidase",
    "translation factor": r"elongation factor|initiation factor|release factor",
}
SHARES = {"test": 0.3, "valid": 0.1}


def family(description: str) -> str | None:
    """The one family a UniProt description names, or None (none or several)."""
    hits = [name for name, pattern in FAMILIES.items() if re.search(pattern, description, re.I)]
    return hits[0] if len(hits) == 1 else None


def labeled(path: Path, max_length: int) -> list[tuple[str, str, str, str]]:
    """(accession, sequence, family, description) of each entry with one family, in file order."""
    from protein_performer.formats.fasta import read_fasta
    rows = []
    for record in read_fasta(path):
        desc = record.description.split(" ", 1)[1].split(" OS=")[0] if " " in record.description else ""
        label = family(desc)
        if label and len(record.sequence) <= max_length:
            rows.append((record.accession, record.sequence, label,
                         desc.replace(" (Fragment)", "")))
    return rows


def split_by_name(rows, seed: int) -> list[str]:
    """Each row's split: per family, whole description groups (shuffled, seeded) fill the test share,
    then the valid share; the rest train."""
    rng = random.Random(seed)
    groups = defaultdict(lambda: defaultdict(list))
    for i, (_, _, label, desc) in enumerate(rows):
        groups[label][desc].append(i)
    split = ["train"] * len(rows)
    for label in sorted(groups):
        names = sorted(groups[label])
        rng.shuffle(names)
        total, filled = sum(len(groups[label][n]) for n in names), Counter()
        for name in names:
            for part, share in SHARES.items():
                if filled[part] < share * total:
                    for i in groups[label][name]:
                        split[i] = part
                    filled[part] += len(groups[label][name])
                    break
    return split


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", type=Path, required=True, help="UniProtKB FASTA with descriptions (uniprotkb_mix_20k)")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--max-length", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rows = labeled(a.input, a.max_length)
    split = split_by_name(rows, a.seed)
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(["id", "sequence", "label", "split"])
    w.writerows([acc, seq, label, s] for (acc, seq, label, _), s in zip(rows, split))
    tmp = a.output.with_name(a.output.name + ".part")
    with open(tmp, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as fh:  # the same bytes every build
        fh.write(text.getvalue().encode())
    tmp.replace(a.output)
    counts = Counter((label, s) for (_, _, label, _), s in zip(rows, split))
    for label in FAMILIES:
        print(f"{label:24s} " + " ".join(f"{s} {counts[label, s]:4d}" for s in ("train", "valid", "test")))
    print(f"wrote {a.output}: {len(rows)} proteins ({Counter(split)})")


if __name__ == "__main__":
    main()
