import pytest

from rlhf.data.tokenizer import ALPHABET, BOS, EOS, SPECIALS, build_tokenizer, load_tokenizer, save_tokenizer


def test_round_trip_and_bos(tmp_path):
    tok = build_tokenizer(32)
    assert tok.get_vocab_size() == 32
    enc = tok.encode("347+58=")
    assert enc.tokens[0] == BOS and enc.tokens[1:] == list("347+58=")
    assert tok.decode(enc.ids) == "347+58="
    save_tokenizer(tok, tmp_path)
    assert load_tokenizer(tmp_path).encode("12+3=").ids == tok.encode("12+3=").ids


def test_every_id_decodes():
    tok = build_tokenizer(32)
    assert all(tok.id_to_token(i) is not None for i in range(32))


def test_transformers_reads_the_files(tmp_path):
    import transformers
    save_tokenizer(build_tokenizer(32), tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token, hf.eos_token, hf.pad_token_id) == (BOS, EOS, SPECIALS.index("<pad>"))
    ids = hf("99+1=").input_ids
    assert hf.decode(ids, skip_special_tokens=True) == "99+1="
    assert hf.decode(hf("100", add_special_tokens=False).input_ids + [hf.eos_token_id]) == "100" + EOS


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least"):
        build_tokenizer(len(SPECIALS) + len(ALPHABET) - 1)
