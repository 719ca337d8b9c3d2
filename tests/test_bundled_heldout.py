"""The bundled held-out sets are what data/README.md says: disjoint from the training sample,
of the stated lengths (read with Biopython, an independent FASTA reader)."""
import gzip

from Bio import SeqIO

from conftest import HELDOUT, ROOT

SAMPLE = ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz"
LONG = ROOT / "data" / "heldout" / "swissprot_long_heldout.fasta.gz"


def sequences(path):
    with gzip.open(path, "rt") as f:
        return {r.id: str(r.seq) for r in SeqIO.parse(f, "fasta")}


def test_long_heldout_is_long_and_shares_no_sequence_with_training_or_the_2k_set():
    long, train, heldout = sequences(LONG), sequences(SAMPLE), sequences(HELDOUT)
    lengths = sorted(map(len, long.values()))
    assert len(long) == 207 and len(set(long.values())) == 207
    assert lengths[0] == 2061 and lengths[103] == 2554 and lengths[-1] == 9904 and sum(n > 4096 for n in lengths) == 29
    assert not set(long.values()) & set(train.values())
    assert not set(long.values()) & set(heldout.values())
    assert not set(long) & set(train)                      # accessions too
    assert all(set(s) <= set("ACDEFGHIKLMNPQRSTVWYXBZUO") for s in long.values())
