import gzip
import shutil
from pathlib import Path

import pytest
from Bio import SeqIO

from protein_performer.formats import ParseError, detect_format, read_records
from protein_performer.formats.fasta import read_fasta
from protein_performer.formats.uniprot import read_uniprot

FIX = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["biopython_SwissProt_multi_ex.fasta", "pyswrd_uniprot_sprot15.fasta"])
def test_fasta_matches_biopython(name):
    ours = list(read_fasta(FIX / name))
    ref = list(SeqIO.parse(FIX / name, "fasta"))
    assert len(ours) == len(ref) > 0
    for a, b in zip(ours, ref):
        assert (a.id, a.description, a.sequence) == (b.id, b.description, str(b.seq))


@pytest.mark.parametrize("name", ["biopython_SwissProt_multi_ex.txt", "emboss_trembl_9records_2012.dat",
                                  "emboss_swissprot_100records_2012.dat", "biopython_SwissProt_P0CK95.txt"])
def test_uniprot_matches_biopython_swiss(name):
    ours = list(read_uniprot(FIX / name))
    ref = list(SeqIO.parse(FIX / name, "swiss"))
    assert len(ours) == len(ref) > 0
    for a, b in zip(ours, ref):
        assert a.id == b.id and a.sequence == str(b.seq)
        assert a.description == b.description


def test_flat_file_and_fasta_of_same_proteins_agree():
    dat = list(read_records(FIX / "biopython_SwissProt_multi_ex.txt"))
    fa = list(read_records(FIX / "biopython_SwissProt_multi_ex.fasta"))
    assert len(dat) == len(fa) == 8
    assert [r.id for r in dat] == [r.accession for r in fa]
    assert [r.sequence for r in dat] == [r.sequence for r in fa]


def test_gzip_transparent_and_format_detection(tmp_path):
    src = FIX / "emboss_trembl_9records_2012.dat"
    gz = tmp_path / "trembl.dat.gz"
    with open(src, "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    assert detect_format(gz) == "uniprot"
    assert [r.sequence for r in read_records(gz)] == [r.sequence for r in read_records(src)]
    noext = tmp_path / "proteins"
    shutil.copy(FIX / "pyswrd_uniprot_sprot15.fasta", noext)
    assert detect_format(noext) == "fasta"


def test_truncated_gzip_is_a_clear_error(tmp_path):
    data = (FIX / "emboss_swissprot_100records_2012.dat").read_bytes()
    gz = tmp_path / "cut.dat.gz"
    gz.write_bytes(gzip.compress(data)[: 40_000])
    with pytest.raises(ParseError, match=r"cut\.dat\.gz:\d+: truncated or corrupt gzip"):
        list(read_uniprot(gz))


def test_malformed_fasta_errors_name_file_record_and_line(tmp_path):
    bad = tmp_path / "bad.fasta"
    bad.write_text("MKTAYIAKQR\n>p1\nMKT\n")
    with pytest.raises(ParseError, match=r"bad\.fasta:1: expected a '>' header"):
        list(read_fasta(bad))
    empty = tmp_path / "empty.fasta"
    empty.write_text(">p1 first\nMKT\n>p2 nothing here\n>p3\nAAA\n")
    with pytest.raises(ParseError, match=r"empty\.fasta:3: record 'p2' has no sequence"):
        list(read_fasta(empty))
    stats = {}
    assert [r.id for r in read_fasta(empty, skip_empty=True, stats=stats)] == ["p1", "p3"]
    assert stats == {"empty": 1}
    assert [r.line for r in read_fasta(empty, skip_empty=True)] == [1, 4]


def test_malformed_flat_file_errors(tmp_path):
    text = (FIX / "emboss_trembl_9records_2012.dat").read_text()
    cut = tmp_path / "cut.dat"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(ParseError, match=r"cut\.dat: record '\w+' \(line \d+\) is truncated"):
        list(read_uniprot(cut))
    junk = tmp_path / "junk.dat"
    junk.write_text("hello\n" + text)
    with pytest.raises(ParseError, match=r"junk\.dat:1: expected an 'ID' line"):
        list(read_uniprot(junk))


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.fasta"):
        list(read_records("nope.fasta"))


def test_flat_file_record_missing_its_terminator_inside_the_sequence_block(tmp_path):
    text = (FIX / "emboss_trembl_9records_2012.dat").read_text()
    first_end = text.index("\n//\n")
    broken = tmp_path / "noterm.dat"
    broken.write_text(text[:first_end + 1] + text[first_end + 4:])  # drop the first record's '//'
    first_id = text.split()[1]
    with pytest.raises(ParseError, match=rf"noterm\.dat:\d+: record '{first_id}' \(line 1\) has no '//' terminator"):
        list(read_uniprot(broken))


def test_bom_and_non_ascii_characters(tmp_path):
    bom = tmp_path / "bom.fasta"
    bom.write_bytes(b"\xef\xbb\xbf>p1 caf\xc3\xa9\nMKT\n")  # UTF-8 with a byte-order mark
    [rec] = read_records(bom)
    assert (rec.id, rec.description, rec.sequence) == ("p1", "p1 café", "MKT")
    gz = tmp_path / "bom.fasta.gz"
    gz.write_bytes(gzip.compress(bom.read_bytes()))
    assert [r.description for r in read_records(gz)] == ["p1 café"]
    utf8 = tmp_path / "u.fasta"
    utf8.write_bytes(">p1\nMKé\n".encode())
    assert list(read_fasta(utf8))[0].sequence == "MKé"  # shown as written, not 'MKÃ©'
    latin1 = tmp_path / "l.fasta"
    latin1.write_bytes(b">p1\nMK\xe9\xff\n")  # not UTF-8: each byte read as Latin-1
    assert list(read_fasta(latin1))[0].sequence == "MKéÿ"
    text = tmp_path / "junk.dat"
    text.write_bytes("ÉTÉ\n".encode())
    with pytest.raises(ParseError, match=r"junk\.dat:1: expected an 'ID' line to start a record, got 'ÉTÉ'"):
        list(read_uniprot(text))


def test_check_source_names_directory_empty_and_binary_files(tmp_path):
    """One check for every reader (formats.check_source): prepared shards, data=sample, evaluate, embed."""
    import gzip as gz

    from protein_performer.data.datamodule import ProteinDataModule
    from protein_performer.errors import UserError
    from protein_performer.formats import check_source
    from protein_performer.sequences import read_sequences
    (tmp_path / "d").mkdir()
    (tmp_path / "empty.fasta").write_bytes(b"")
    (tmp_path / "empty.fasta.gz").write_bytes(gz.compress(b""))
    (tmp_path / "bin.fasta").write_bytes(bytes(range(256)) * 4)
    cases = {"d": "is a directory", "empty.fasta": "is empty", "empty.fasta.gz": "is empty",
             "bin.fasta": "is a binary file"}
    for name, what in cases.items():
        with pytest.raises(UserError, match=f"{name}: {what}"):
            check_source(tmp_path / name)
        with pytest.raises(UserError, match=f"{name}: {what}"):
            list(read_sequences(tmp_path / name))
        with pytest.raises(UserError, match=f"data.path={tmp_path / name}: {what}"):
            ProteinDataModule(str(tmp_path / name)).setup()


def test_registry_tells_formats_apart_and_prepare_refuses_tables(tmp_path):
    from protein_performer.data.prepare import prepare
    from protein_performer.errors import UserError
    from protein_performer.formats import FORMATS, SHARD_FORMATS
    assert list(FORMATS) == ["fasta", "uniprot", "csv", "tsv"] and SHARD_FORMATS == ("fasta", "uniprot")
    tsv = tmp_path / "a.tsv.gz"
    tsv.write_bytes(gzip.compress(b"id\tseq\nq1\tMKT\nq2\t \nq3\tACD\n"))
    assert detect_format(tsv) == "tsv"
    with pytest.raises(ParseError, match=r"a\.tsv\.gz:3: record 'q2' has no sequence"):
        list(read_records(tsv))
    stats = {}
    assert [(r.id, r.sequence, r.line) for r in read_records(tsv, skip_empty=True, stats=stats)] == \
        [("q1", "MKT", 2), ("q3", "ACD", 4)]
    assert stats == {"empty": 1}
    plain = tmp_path / "table.txt"  # the name says UniProt; the setting says TSV
    plain.write_text("seq\tid\nMKV\tz\n")
    assert [(r.id, r.sequence) for r in read_records(plain, "tsv")] == [("z", "MKV")]
    csv = tmp_path / "a.csv"
    csv.write_text("id,seq\nq1,MKT\n")
    with pytest.raises(UserError, match=r"a\.csv: a CSV table; preparation reads FASTA or UniProt flat files"):
        prepare(csv, data_dir=tmp_path / "cache", progress=False)
    with pytest.raises(UserError, match=r"^unknown format 'csv' \(expected 'fasta' or 'uniprot'\)$"):
        prepare(FIX / "pyswrd_uniprot_sprot15.fasta", format="csv", data_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()  # refused before anything is written
