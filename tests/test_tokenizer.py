import numpy as np
import pytest

from protein_performer.tokenizer import AMINO_ACIDS, InvalidSequenceError, Tokenizer


def test_vocabulary_layout():
    tok = Tokenizer()
    assert tok.tokens[:5] == ("<pad>", "<mask>", "<cls>", "<eos>", "<unk>")
    assert tok.vocab_size == 5 + 25
    assert set("ACDEFGHIKLMNPQRSTVWYXBZUO") == set(AMINO_ACIDS)
    assert [tok.tokens[i] for i in tok.standard_aa_ids] == list("ACDEFGHIKLMNPQRSTVWY")


def test_round_trip_exact():
    tok = Tokenizer()
    seq = "MKTAYIAKQRQISFVKSHFSRQXBZUO"
    ids = tok.encode(seq)
    assert ids.dtype == np.uint8
    assert ids[0] == tok.cls_id and ids[-1] == tok.eos_id and len(ids) == len(seq) + 2
    # hand-computed ids: M is the 11th standard amino acid (index 10) -> 5 + 10
    assert ids[1] == 5 + "ACDEFGHIKLMNPQRSTVWY".index("M") == 15
    assert tok.decode(ids) == seq
    assert tok.decode(ids, keep_special=True) == "<cls>" + seq + "<eos>"
    assert tok.decode(tok.encode(seq, add_cls=False, add_eos=False)) == seq


def test_case_whitespace_and_stop():
    tok = Tokenizer()
    assert tok.decode(tok.encode(" mkt ay\nia\t*")) == "MKTAYIA"
    assert np.array_equal(tok.encode("mkta"), tok.encode("MKTA"))


def test_invalid_residue_names_file_record_and_character():
    tok = Tokenizer()
    with pytest.raises(InvalidSequenceError) as e:
        tok.encode("MKT1AY", source="prots.fasta:12", record="P12345")
    msg = str(e.value)
    assert "prots.fasta:12" in msg and "P12345" in msg and "'1'" in msg and "position 4" in msg
    with pytest.raises(InvalidSequenceError):
        tok.encode("MK*T")  # a '*' inside the sequence is not a stop codon


def test_unknown_mapped_to_x_or_unk_when_configured():
    x = Tokenizer(unknown="X")
    assert x.decode(x.encode("MK#T")) == "MKXT"
    u = Tokenizer(unknown="unk")
    ids = u.encode("MK#T", add_cls=False, add_eos=False)
    assert list(ids) == [u.encode("M", add_cls=False, add_eos=False)[0], u.encode("K", add_cls=False, add_eos=False)[0],
                         u.unk_id, u.encode("T", add_cls=False, add_eos=False)[0]]
    with pytest.raises(ValueError):
        Tokenizer(unknown="skip")


def test_non_ascii_is_never_silently_turned_into_residues():
    with pytest.raises(InvalidSequenceError, match="'ß'"):
        Tokenizer().encode("MKßT")
    x = Tokenizer(unknown="X")
    assert x.decode(x.encode("MKßT")) == "MKXT"
