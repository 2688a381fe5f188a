"""A character-level tokenizer built with `tokenizers`, saved as an HF fast tokenizer.

One token per character of the task alphabet, one per whole word of `words` (the tool task's tags,
`<calc>`: matched before the text is split into characters), plus special tokens, padded with reserved tokens to a
fixed vocabulary size so that every id the model can emit decodes to something. The files
(tokenizer.json, tokenizer_config.json, special_tokens_map.json) are what transformers'
`AutoTokenizer` and vLLM load.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
ALPHABET = "0123456789+-*=?: "


def build_tokenizer(vocab_size: int = 32, alphabet: str = ALPHABET, words: tuple[str, ...] = ()) -> Tokenizer:
    n_reserved = vocab_size - len(SPECIALS) - len(alphabet) - len(words)
    if n_reserved < 0:
        raise ValueError(f"vocab_size={vocab_size} is too small for {len(SPECIALS)} special tokens, "
                         f"{len(alphabet)} characters and {len(words)} words; use at least "
                         f"{len(SPECIALS) + len(alphabet) + len(words)}")
    tokens = list(SPECIALS) + list(alphabet) + list(words) + [f"<reserved_{i}>" for i in range(n_reserved)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in words])  # kept when decoding
    # Every encoded text starts with <bos>, in our code, transformers and vLLM alike.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, SPECIALS.index(BOS))])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 128) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
                "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **specials,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
