"""The shared inference layer: one checkpoint loader, one sequence reader with one
invalid-record policy, one padding rule."""
import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.files import file_sha256
from protein_performer.hub.load import load_model, weights_sha256
from protein_performer.data.collate import pad_batch
from protein_performer.sequences import read_sequences
from protein_performer.formats import ParseError
from protein_performer.formats.tabular import sequence_id
from protein_performer.training.task import ProteinLM
from protein_performer.tokenizer import InvalidSequenceError, Tokenizer

from conftest import save_checkpoint as save

FIX = Path(__file__).parent / "fixtures"


def tiny(objective="mlm", seed=0):
    torch.manual_seed(seed)
    return ProteinLM(model=dict(dim=16, depth=1, heads=2, attention=dict(kernel="relu", nb_features=8)),
                     objective=objective).eval()


def test_load_model_from_path_module_and_bare_net(tmp_path):
    m = tiny("clm")
    path = save(m, tmp_path / "m.ckpt")
    loaded = load_model(path)
    assert loaded.source == str(path) and loaded.kernel == "relu" and loaded.causal
    assert loaded.task is not None and loaded.task.hparams.objective == "clm"
    assert not loaded.net.training
    # the same weights, whichever way they arrive
    assert weights_sha256(loaded.net) == weights_sha256(m.model) == weights_sha256(load_model(m.model).net)
    assert weights_sha256(tiny(seed=1).model) != weights_sha256(tiny(seed=0).model)
    bare = load_model(m.model)
    assert bare.task is None and bare.source == "PerformerLM" and isinstance(bare.tokenizer, Tokenizer)


def test_load_model_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nope\.ckpt: no such file"):
        load_model(tmp_path / "nope.ckpt")
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint\n")
    with pytest.raises(UserError, match=r"^checkpoint .*junk\.ckpt: cannot load \("):
        load_model(junk)
    with pytest.raises(UserError, match=r"checkpoint .*: is a directory without config\.json"):
        load_model(tmp_path)


def test_load_model_from_an_exported_directory(tmp_path):
    from protein_performer.hub.export import export
    m = tiny("clm")
    v = m.tokenizer.vocab_size
    m.hparams.aa_frequencies = [float(i) / (v * (v - 1) / 2) for i in range(v)]
    ckpt = save(m, tmp_path / "m.ckpt")
    out = export(ckpt, tmp_path / "exported")
    a, b = load_model(ckpt), load_model(out)
    assert b.task is None and b.source == str(out) and b.causal and b.objective == "clm" and b.kernel == "relu"
    assert weights_sha256(a.net) == weights_sha256(b.net)  # the same model, whichever form it comes in
    torch.testing.assert_close(b.aa_frequencies, a.aa_frequencies)
    tokens = torch.tensor(a.tokenizer.encode("MKTAYIAKQR"), dtype=torch.long)[None]
    with torch.no_grad():
        torch.testing.assert_close(b.net(tokens), a.net(tokens))


def test_file_sha256_is_the_hash_of_the_bytes(tmp_path):
    import hashlib
    p = tmp_path / "x"
    p.write_bytes(b"abc" * 1000)
    assert file_sha256(p) == hashlib.sha256(b"abc" * 1000).hexdigest()


def test_fasta_dat_csv_and_in_memory_sources(tmp_path):
    tok = Tokenizer()
    fa = tmp_path / "a.fasta"
    fa.write_text(">p1 desc\nMKT\nAYI\n>p2\nmkv*\n")
    got = [(e.id, e.where, e.tokens.tolist()) for e in read_sequences(fa)]
    assert got == [("p1", f"{fa}:1", tok.encode("MKTAYI").tolist()), ("p2", f"{fa}:4", tok.encode("MKV").tolist())]
    csv_gz = tmp_path / "a.csv.gz"
    with gzip.open(csv_gz, "wt") as fh:
        fh.write("label,seq\n1,MKTAYI\n0,ACD\n")
    assert [(e.id, e.where) for e in read_sequences(csv_gz)] == [(sequence_id("MKTAYI"), f"{csv_gz}:2"),
                                                                 (sequence_id("ACD"), f"{csv_gz}:3")]
    tsv = tmp_path / "a.tsv"
    tsv.write_text("id\tsequence\nq1\tMKT\n")
    assert [(e.id, e.sequence) for e in read_sequences(tsv)] == [("q1", "MKT")]
    dat = [e.id for e in read_sequences(FIX / "emboss_trembl_9records_2012.dat")]
    assert len(dat) == 9
    assert [e.id for e in read_sequences({"a": "MKT", "b": "ACD"})] == ["a", "b"]
    assert [e.id for e in read_sequences(["MKT", ("x", "ACD")])] == ["0", "x"]


def test_one_invalid_record_policy_with_counts(tmp_path, caplog):
    fa = tmp_path / "bad.fasta"
    fa.write_text(">a\nMKTAYIAK\n>b\nMKJAYIAK\n>a\nmktayiak\n>c\n>d\nACDEF\n>a\nMKTAYIAKQQ\n")
    with pytest.raises(InvalidSequenceError, match=r"bad\.fasta:3: record 'b': invalid residue 'J' at position 3"):
        list(read_sequences(fa))
    caplog.set_level("WARNING")
    stats = {}
    ids = [e.id for e in read_sequences(fa, on_invalid="skip", stats=stats)]
    assert ids == ["a", "d"]
    # 'b' (J) and the third 'a' (another sequence under a seen id) are invalid; the second 'a'
    # is the same protein again (case and whitespace do not matter); 'c' is empty
    assert stats == {"empty": 1, "invalid": 2, "duplicate": 1}
    assert f"{fa}:5: record 'a' repeats the id and sequence first seen at {fa}:1" in caplog.text
    assert f"{fa}:10: record 'a' repeats the id first seen at {fa}:1 with a different sequence" in caplog.text
    # a conflicting duplicate is an error of its own when nothing else is wrong
    fa.write_text(">a\nMKT\n>a\nMKT\n>a\nMKV\n")
    with pytest.raises(ParseError, match=rf"bad\.fasta:5: record 'a' repeats the id first seen at {fa}:1 "
                                         r"with a different sequence"):
        list(read_sequences(fa))
    assert [e.id for e in read_sequences(fa, unknown="X", on_invalid="skip")] == ["a"]
    # unknown=X maps instead of skipping
    fa.write_text(">b\nMKJ\n")
    [e] = read_sequences(fa, unknown="X")
    assert e.tokens.tolist() == Tokenizer().encode("MKX").tolist()
    caplog.clear()
    list(read_sequences(fa, on_invalid="skip", warn=False))
    assert "skipped" not in caplog.text


def test_csv_errors_name_file_and_line(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("id,label\na,1\n")
    with pytest.raises(ParseError, match=r"x\.csv:1: CSV header .* no 'seq'"):
        list(read_sequences(p))
    p.write_text("id,seq\na,MKT\nb\n")
    with pytest.raises(ParseError, match=r"x\.csv:3: expected 2 columns, got 1"):
        list(read_sequences(p))
    p.write_text('id,seq\na,"MK"T\n')
    with pytest.raises(ParseError, match=r"x\.csv:\d+: not a readable CSV file"):
        list(read_sequences(p))
    gz = tmp_path / "cut.csv.gz"
    gz.write_bytes(gzip.compress(("id,seq\n" + "".join(f"p{i},MKTAYIAKQR\n" for i in range(5000))).encode())[:3000])
    with pytest.raises(ParseError, match=r"cut\.csv\.gz:\d+: truncated or corrupt gzip"):
        list(read_sequences(gz))


def test_pad_batch_by_hand():
    tokens, mask = pad_batch([np.array([2, 5, 6, 3], np.uint8), np.array([2, 7, 3], np.uint8)], pad_id=0)
    assert tokens.dtype == torch.long
    assert tokens.tolist() == [[2, 5, 6, 3], [2, 7, 3, 0]]
    assert mask.tolist() == [[False] * 4, [False, False, False, True]]
    tokens, mask = pad_batch([np.array([2, 5, 3]), np.array([2, 6, 3])], pad_id=0)
    assert mask is None and tokens.tolist() == [[2, 5, 3], [2, 6, 3]]
