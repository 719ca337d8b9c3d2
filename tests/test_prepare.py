"""Preparation against independent references: the line-based readers of formats/ plus
Tokenizer.encode, a Python set for de-duplication, the split formula computed by hand,
byte comparison of shards after a kill."""
import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from protein_performer.formats import ParseError, accession, iter_ranges, iter_text_blocks
from protein_performer.data.split import split_codes
from protein_performer.data.dedup import HashSet
from protein_performer.data.prepare import prepare
from protein_performer.data.shards import PreparedData
from protein_performer.data.split import SPLITS
from protein_performer.formats.fasta import read_fasta
from protein_performer.formats.text import BlockParseError
from protein_performer.formats.uniprot import read_uniprot
from protein_performer.tokenizer import InvalidSequenceError, Tokenizer

from conftest import ROOT, SAMPLE

TK = Tokenizer()


def reference(records, valid=0.1, test=0.1, tokenizer=TK):
    """What preparation must produce, computed the slow, obvious way."""
    out = {s: [] for s in SPLITS}
    counts = {k: {s: 0 for s in SPLITS} for k in ("records_read", "kept", "duplicates", "invalid")}
    seen = set()
    for rec in records:
        acc = rec.accession.encode("latin-1")
        u = xxhash.xxh3_64_intdigest(acc) / 2**64
        s = "valid" if u < valid else "test" if u < valid + test else "train"
        counts["records_read"][s] += 1
        try:
            ids = tokenizer.encode(rec.sequence, add_cls=False)
        except InvalidSequenceError:
            counts["invalid"][s] += 1
            continue
        if len(ids) == 1 or not rec.id:  # no residues (only eos) or no id
            counts["invalid"][s] += 1
            continue
        key = ids.tobytes()
        if key in seen:
            counts["duplicates"][s] += 1
            continue
        seen.add(key)
        counts["kept"][s] += 1
        out[s].append(ids)
    return out, counts


def prepared_records(path):
    data = PreparedData(path)
    shards = {s: data.split(s) for s in SPLITS}
    return {s: [np.array(sh[i]) for i in range(len(sh))] for s, sh in shards.items()}, data


def assert_matches(path, ref, counts):
    got, data = prepared_records(path)
    m = data.manifest
    for s in SPLITS:
        assert len(got[s]) == len(ref[s]), s
        for a, b in zip(got[s], ref[s]):
            np.testing.assert_array_equal(a, b)
        for k in counts:
            assert m["splits"][s][k] == counts[k][s], (s, k)
        c = m["splits"][s]
        assert c["records_read"] == c["kept"] + c["duplicates"] + c["invalid"]
    assert m["records_read"] == m["kept"] + m["duplicates"] + m["invalid"]
    assert sum(m["length_histogram"]["counts"]) == m["kept"]


TRICKY = (
    b"; a comment before the first record\n\n"
    b">sp|P1|ONE_HUMAN first protein OS=Homo\nMKV LLA\r\nacde*\n"
    b">tr|Q2|TWO_X\nMKVLLAACDE\n"                      # duplicate of P1 (case, spaces, stop)
    b">bad1 has J\nMKJLL\n"                             # invalid residue
    b">empty\n\n"                                       # no sequence
    b">star_only\n*\n"                                  # nothing left after the stop
    b">   spaced   header\nWWWW\n"
    b">\nMMMM\n"                                        # empty header
    b">gt inside\nMK>LL\n"                              # a stray '>' in sequence data
    b">last_no_newline\nPPPPG"
)


def write(tmp_path, name, data, gz=False):
    p = tmp_path / name
    p.write_bytes(gzip.compress(data) if gz else data)
    return p


@pytest.mark.parametrize("block_size", [16, 1 << 20])
def test_block_tokenizer_matches_read_fasta_on_tricky_input(tmp_path, block_size):
    path = write(tmp_path, "t.fasta", TRICKY)
    # read_fasta rejects an empty header and drops an empty record itself; preparation
    # counts both as invalid, so the reference reads a copy without them and adds them
    plain = write(tmp_path, "ref.fasta", TRICKY.replace(b">\nMMMM\n", b""))
    ref, counts = reference(read_fasta(plain, skip_empty=True), 0.3, 0.3)
    for acc in (b"empty", b""):
        u = xxhash.xxh3_64_intdigest(acc) / 2**64
        s = "valid" if u < 0.3 else "test" if u < 0.6 else "train"
        counts["records_read"][s] += 1
        counts["invalid"][s] += 1
    out = prepare(path, data_dir=tmp_path / "cache", valid_fraction=0.3, test_fraction=0.3, workers=0,
                  block_size=block_size, blocks_per_part=2, progress=False)
    assert_matches(out, ref, counts)
    m = PreparedData(out).manifest
    assert m["invalid"] == 5 and m["duplicates"] == 1
    assert f"{path}:8: record 'bad1': invalid residue 'J' at position 3" in m["invalid_examples"]


@pytest.mark.parametrize("workers,gz", [(0, False), (2, False), (2, True)])
def test_prepare_sample_equals_reference(tmp_path, workers, gz):
    raw = gzip.decompress(SAMPLE.read_bytes())[: 3 << 20]
    raw = raw[: raw.rfind(b"\n>") + 1]
    raw = raw + raw[: 200_000][: raw[:200_000].rfind(b"\n>") + 1]  # some exact duplicates
    path = write(tmp_path, "s.fasta" + (".gz" if gz else ""), raw, gz)
    ref, counts = reference(read_fasta(path), 0.05, 0.05)
    assert sum(counts["duplicates"].values()) > 100
    out = prepare(path, data_dir=tmp_path / "cache", valid_fraction=0.05, test_fraction=0.05, workers=workers,
                  block_size=256 << 10, blocks_per_part=3, progress=False)
    assert_matches(out, ref, counts)
    assert len(list((out / "parts").glob("*.json"))) >= 3


def uniprot_text(records) -> bytes:
    """Render records as a UniProt flat file (the layout of uniprot_trembl.dat)."""
    lines = []
    for i, r in enumerate(records):
        seq = r.sequence
        lines.append(f"ID   {r.id}_X{i}   Unreviewed;   {len(seq)} AA.")
        lines.append(f"AC   {r.id}; Z{i:05d};")
        lines.append(f"AC   Y{i:05d};")
        lines.append("DE   RecName: Full=Something;")
        lines.append(f"SQ   SEQUENCE   {len(seq)} AA;  1 MW;  0 CRC64;")
        for j in range(0, len(seq), 60):
            chunk = seq[j:j + 60]
            lines.append("     " + " ".join(chunk[k:k + 10] for k in range(0, len(chunk), 10)))
        lines.append("//")
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize("gz", [False, True])
def test_prepare_uniprot_dat_equals_read_uniprot(tmp_path, gz):
    recs = [r for _, r in zip(range(1500), read_fasta(SAMPLE))]
    recs[7].sequence = recs[7].sequence[:5] + "J" + recs[7].sequence[6:]  # one invalid
    recs[9].sequence = recs[3].sequence  # one duplicate
    path = write(tmp_path, "u.dat" + (".gz" if gz else ""), uniprot_text(recs), gz)
    ref, counts = reference(read_uniprot(path), 0.1, 0.1)
    out = prepare(path, data_dir=tmp_path / "c", valid_fraction=0.1, test_fraction=0.1, workers=2,
                  block_size=64 << 10, progress=False)
    assert_matches(out, ref, counts)
    m = PreparedData(out).manifest
    assert m["invalid"] == 1 and m["duplicates"] == 1 and m["source"]["format"] == "uniprot"


def test_blocks_are_cut_the_same_way_plain_gzip_and_by_ranges(tmp_path):
    raw = gzip.decompress(SAMPLE.read_bytes())[: 1 << 20]
    plain, gz = write(tmp_path, "a.fasta", raw), write(tmp_path, "a.fasta.gz", raw, True)
    a = [(o, len(b)) for o, b in iter_text_blocks(plain, "fasta", 50_000)]
    b = [(o, len(b)) for o, b in iter_text_blocks(gz, "fasta", 50_000)]
    c = list(iter_ranges(plain, "fasta", 50_000))
    assert a == b == c and len(a) > 10
    assert b"".join(x for _, x in iter_text_blocks(gz, "fasta", 50_000)) == raw
    for o, _ in a[1:]:
        assert raw[o - 1:o + 1] == b"\n>"
    resumed = [(o, len(b)) for o, b in iter_text_blocks(gz, "fasta", 50_000, start=a[4][0])]
    assert resumed == a[4:]


def test_bad_input_errors_name_file_and_line(tmp_path):
    p = write(tmp_path, "bad.fasta", b"\n\nMKV\n>x\nMK\n")
    with pytest.raises(ParseError, match=r"bad\.fasta:3: expected a '>' header"):
        prepare(p, data_dir=tmp_path / "c", workers=0, progress=False)
    good = gzip.compress(b">a\nMKV\n" * 2000)
    p = write(tmp_path, "trunc.fasta.gz", b"")
    p.write_bytes(good[: len(good) // 2])
    with pytest.raises(ParseError, match="trunc.fasta.gz: truncated gzip"):
        prepare(p, data_dir=tmp_path / "c", workers=0, progress=False)
    p = write(tmp_path, "inv.fasta", b">a\nMKV\n>b\nMKB1\n")
    with pytest.raises(ParseError, match=r"inv\.fasta:3: record 'b': invalid residue '1' at position 4"):
        prepare(p, data_dir=tmp_path / "c", workers=0, progress=False, on_invalid="error")
    p = write(tmp_path, "t.dat", b"ID   A   Reviewed;\nAC   P1;\nSQ   SEQUENCE\n     MKV\n")
    with pytest.raises(ParseError, match=r"t\.dat:1: record 'P1' is truncated"):
        prepare(p, data_dir=tmp_path / "c", workers=0, progress=False)


def test_a_flat_file_record_without_its_terminator_names_the_files_line(tmp_path):
    """The byte-level reader finds the missing '//' in a block of records (in a worker, which cannot
    know the block's place in the file): the error names the line of the file, as the line reader
    does, not a line within the block."""
    records = [f"ID   E{k}   Reviewed;\nAC   P{k};\nDE   protein {k}\nSQ   SEQUENCE\n     MKVLA GHTW\n//\n"
               for k in range(8)]
    records[5] = records[5].replace("//\n", "")  # record P5, at line 31, runs into the next one
    p = write(tmp_path, "cut.dat", "".join(records).encode())
    message = (f"{p}:31: record 'P5' is truncated: no '//' terminator before the next record or the end of "
               f"the file")
    with pytest.raises(ParseError) as e:
        prepare(p, data_dir=tmp_path / "c", workers=0, progress=False, block_size=100)
    assert str(e.value) == message
    with pytest.raises(ParseError) as e:  # the same when the source is one block
        prepare(p, data_dir=tmp_path / "c", workers=0, progress=False)
    assert str(e.value) == message
    again = pickle.loads(pickle.dumps(BlockParseError(str(p), 12, "why")))  # as it comes back from a worker
    assert str(again.in_file(19)) == f"{p}:32: why"


def test_unknown_residues_can_map_to_x(tmp_path):
    p = write(tmp_path, "x.fasta", b">a\nMKJ*\n>b\nMK1L\n")
    out = prepare(p, data_dir=tmp_path / "c", workers=0, progress=False, unknown="X", valid_fraction=0,
                  test_fraction=0)
    got, _ = prepared_records(out)
    tk = Tokenizer(unknown="X")
    np.testing.assert_array_equal(got["train"][0], tk.encode("MKJ", add_cls=False))
    np.testing.assert_array_equal(got["train"][1], tk.encode("MK1L", add_cls=False))


def test_split_codes_follow_the_formula():
    ids = [f"P{i:05d}".encode() for i in range(5000)]
    codes = split_codes(ids, 0.1, 0.2)
    for i, c in zip(ids, codes):
        u = xxhash.xxh3_64_intdigest(i) / 2**64
        assert c == (1 if u < 0.1 else 2 if u < 0.1 + 0.2 else 0)
    assert 0.07 < np.mean(codes == 1) < 0.13 and 0.17 < np.mean(codes == 2) < 0.23
    assert accession(b"sp|P12345|NAME_HUMAN") == b"P12345" and accession(b"tr|A|B|C") == b"A"
    assert accession(b"sp|P12345") == b"sp|P12345" and accession(b"XP_1.1") == b"XP_1.1"


def test_hash_set_agrees_with_python_set():
    rng = np.random.default_rng(0)
    hs, ref = HashSet(16), set()
    for _ in range(30):
        keys = rng.integers(0, 3000, size=rng.integers(1, 500)).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        got = hs.add(keys)
        want = []
        for k in keys.tolist():
            want.append(k not in ref)
            ref.add(k)
        np.testing.assert_array_equal(got, want)
    assert len(hs) == len(ref)


def _shard_bytes(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.parent.name in SPLITS}


def test_stopped_preparation_resumes_to_identical_shards(tmp_path):
    raw = gzip.decompress(SAMPLE.read_bytes())[: 2 << 20]
    raw = raw[: raw.rfind(b"\n>") + 1]
    path = write(tmp_path, "r.fasta.gz", raw + raw[:300_000][: raw[:300_000].rfind(b"\n>") + 1], True)
    kw = dict(workers=2, block_size=64 << 10, blocks_per_part=4, progress=False)
    full = prepare(path, out_dir=tmp_path / "full", **kw)
    part = prepare(path, out_dir=tmp_path / "part", max_parts=3, **kw)
    assert not (part / "manifest.json").exists() and len(list((part / "parts").glob("*.json"))) == 3
    (part / "train" / "00003.tokens").write_bytes(b"junk from a killed run")
    part = prepare(path, out_dir=tmp_path / "part", **kw)
    assert _shard_bytes(full) == _shard_bytes(part)
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (full, part))
    for m in (a, b):
        m.pop("seconds_last_run")
    assert a == b


def test_killed_preparation_resumes_to_identical_shards(tmp_path):
    raw = gzip.decompress(SAMPLE.read_bytes())
    path = write(tmp_path, "k.fasta", raw + raw[: 1 << 20][: raw[: 1 << 20].rfind(b"\n>") + 1])
    kw = dict(workers=0, block_size=32 << 10, blocks_per_part=2, progress=False)
    code = (f"from protein_performer.data.prepare import prepare; "
            f"prepare({str(path)!r}, out_dir={str(tmp_path / 'k')!r}, **{kw!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    parts = tmp_path / "k" / "parts"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(parts.glob("*.json"))) < 5:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (tmp_path / "k" / "manifest.json").exists():
        pytest.skip("preparation finished before it could be killed")
    out = prepare(path, out_dir=tmp_path / "k", **kw)
    full = prepare(path, out_dir=tmp_path / "full", **kw)
    assert _shard_bytes(full) == _shard_bytes(out)


def test_prepared_data_is_cached_by_content(tmp_path, capsys):
    p = write(tmp_path, "c.fasta", b">a\nMKV\n>b\nMKL\n")
    out1 = prepare(p, data_dir=tmp_path / "cache", workers=0, progress=False)
    assert str(out1) in capsys.readouterr().out  # the folder is printed
    mtime = (out1 / "manifest.json").stat().st_mtime_ns
    assert prepare(p, data_dir=tmp_path / "cache", workers=0, progress=False) == out1
    assert (out1 / "manifest.json").stat().st_mtime_ns == mtime
    os.utime(p, ns=(1, 1))  # same content, new mtime: same folder
    assert prepare(p, data_dir=tmp_path / "cache", workers=0, progress=False) == out1
    p.write_bytes(b">a\nMKV\n>b\nMKW\n")
    assert prepare(p, data_dir=tmp_path / "cache", workers=0, progress=False) != out1
    assert out1.parent == tmp_path / "cache" / "prepared"


def test_prepare_command_imports_neither_torch_nor_lightning(tmp_path):
    """`protein-performer prepare` (scripts/prepare_data.py) prepares from the config alone, so an
    already prepared file answers without the seconds torch and Lightning take to import."""
    src = tmp_path / "p.fasta"
    src.write_text("".join(f">P{i:05d}\nMKTAYIAKQR{''.join('ACDEFGHIKL'[int(d)] for d in f'{i:05d}')}\n" for i in range(200)))
    code = ("import sys; from protein_performer.cli import run\n"
            "try:\n    run('prepare', sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('LOADED', sorted(m for m in ('torch', 'pytorch_lightning', 'wandb') if m in sys.modules))")
    args = ["data=fasta", f"data.path={src}", f"data.data_dir={tmp_path / 'cache'}", "data.prepare_workers=0",
            "data.progress=false", "data.valid_fraction=0.2"]
    for _ in range(2):  # prepares, then finds it prepared
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "200 read = 200 kept" in out.stdout, out.stdout
        assert "LOADED []" in out.stdout


def test_bom_is_accepted_and_non_ascii_is_shown_as_written(tmp_path):
    recs = "".join(f">P{i:05d}\nMKTAYIAKQR{''.join('ACDEFGHIKL'[int(d)] for d in f'{i:05d}')}\n" for i in range(60))
    plain, bom = tmp_path / "plain.fasta", tmp_path / "bom.fasta"
    plain.write_text(recs)
    bom.write_bytes(b"\xef\xbb\xbf" + recs.encode())
    a = PreparedData(prepare(plain, data_dir=tmp_path / "a", workers=0, progress=False)).manifest
    b = PreparedData(prepare(bom, data_dir=tmp_path / "b", workers=0, progress=False)).manifest
    assert a["kept"] == b["kept"] == 60 and a["tokens"] == b["tokens"]
    bad = tmp_path / "bad.fasta"
    bad.write_text("protéine sans en-tête\n>P1\nMK\n", encoding="utf-8")
    with pytest.raises(ParseError, match="protéine"):
        prepare(bad, data_dir=tmp_path / "c", workers=0, progress=False)


# --- a repeated id: as every other command (protein_performer.sequences) treats it ------------
REPEATED = (b">a first\nMKVL\n"
            b">b\nMKLL\n"
            b">a again, same protein\nMKVL\n"        # line 5: the same record twice: a duplicate
            b">c\nMKLL\n"                           # another id, the sequence of b: a duplicate
            b">b other\nMWWW\n"                     # line 9: b's id with another sequence
            b">d\nMWWW\n")                          # another id with that sequence: kept


@pytest.mark.parametrize("dedup", [True, False])
def test_a_repeated_id_with_another_sequence_is_refused_or_counted_like_other_commands(tmp_path, dedup):
    from protein_performer.sequences import read_sequences
    path = write(tmp_path, "rep.fasta", REPEATED)
    kw = dict(workers=0, valid_fraction=0, test_fraction=0, dedup=dedup, progress=False)
    with pytest.raises(ParseError) as e:
        prepare(path, data_dir=tmp_path / "c", on_invalid="error", **kw)
    assert str(e.value).startswith(f"{path}:9: record 'b': repeats an earlier record's id with a different sequence")
    assert not (tmp_path / "c" / "prepared").exists()
    with pytest.raises(ParseError, match=rf"{path}:9: record 'b' repeats the id first seen at {path}:3"):
        list(read_sequences(path))  # what evaluate, embed and data=sample say about the same file
    stats = {}
    expected = [e.sequence for e in read_sequences(path, on_invalid="skip", stats=stats)]
    assert expected == ["MKVL", "MKLL", "MKLL", "MWWW"] and stats == {"empty": 0, "invalid": 1, "duplicate": 1}
    out = prepare(path, data_dir=tmp_path / "c", on_invalid="skip", **kw)
    m = PreparedData(out).manifest
    kept = [TK.decode(np.array(s[:-1])) for s in prepared_records(out)[0]["train"]]
    if dedup:  # and identical sequences under other ids go too
        assert kept == ["MKVL", "MKLL", "MWWW"] and (m["kept"], m["duplicates"], m["invalid"]) == (3, 2, 1)
    else:
        assert kept == expected and (m["kept"], m["duplicates"], m["invalid"]) == (4, 1, 1)
    assert m["invalid_examples"] == [f"{path}:9: record 'b': repeats an earlier record's id with a different sequence"]


def test_repeated_ids_are_found_across_parts_after_a_resume(tmp_path):
    path = write(tmp_path, "rep.fasta", REPEATED)
    kw = dict(workers=0, valid_fraction=0, test_fraction=0, block_size=8, blocks_per_part=1, progress=False)
    full = prepare(path, out_dir=tmp_path / "full", on_invalid="skip", **kw)
    part = prepare(path, out_dir=tmp_path / "part", on_invalid="skip", max_parts=3, **kw)  # b's first line: part 1
    assert not (part / "manifest.json").exists() and (part / "parts" / "00002.ids.npy").is_file()
    part = prepare(path, out_dir=tmp_path / "part", on_invalid="skip", **kw)
    assert _shard_bytes(full) == _shard_bytes(part)
    assert PreparedData(part).manifest["invalid"] == 1
