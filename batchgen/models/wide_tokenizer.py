"""A byte-level BPE tokenizer of any vocabulary size, built from a seed without training.

Benchmarks of random-weight presets (vocabularies of 128,256 or 151,936 tokens) need a
tokenizer of that size wherever a cost depends on the token strings, as a grammar's token
masks do. Training BPE to 150k merges needs a large corpus and minutes; this builds the
vocabulary directly instead, from token strings shaped like a real one's: words with and
without a leading space, capitalised words, word pieces, digit runs, punctuation and code
clusters (JSON's `{"`, `":`, `",` among them), whitespace runs and multi-byte characters.
Each token of length L enters with the merges that build it from its prefixes (its prefixes
become tokens too, as in trained BPE), so the merge list is valid and any text encodes.
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from batchgen.models.tiny_tokenizer import BOS, EOS, ROLE_TOKENS

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_ONSETS = ["th", "st", "ch", "sh", "pr", "tr", "br", "cl", "gr", "pl", "sp", "wh"]
_CODAS = ["ng", "nt", "st", "rd", "ck", "ll", "ss", "ty", "ly", "er", "ed", "es", "ion"]
_PUNCT = list("{}[]()\":,.;_-=+*/\\<>!?'#@&%$|`~^")
_JSON = ['{"', '":', '",', '"}', "},", "],", '":"', '","', '":[', '":{', '":"', '"]', "}}", "[{"]
_WHITESPACE = [" " * n for n in range(2, 17)] + ["\n", "\n\n", "\t", "\t\t", "\n  ", "\n    "]


def _byte_chars() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable stand-in for each byte (GPT-2's table)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _word(rng: random.Random) -> str:
    syllables = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
    parts = []
    for _ in range(syllables):
        onset = rng.choice(_ONSETS) if rng.random() < 0.25 else rng.choice(_CONSONANTS)
        coda = rng.choice(_CODAS) if rng.random() < 0.2 else ""
        parts.append(onset + rng.choice(_VOWELS) + coda)
    return "".join(parts)


def _candidate(rng: random.Random) -> str:
    """One token string, drawn from a mix shaped like a large real vocabulary's."""
    r = rng.random()
    if r < 0.45:
        return " " + _word(rng)
    if r < 0.62:
        return _word(rng)
    if r < 0.70:
        return " " + _word(rng).capitalize()
    if r < 0.74:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
    if r < 0.80:
        return rng.choice(_JSON) if rng.random() < 0.3 else _punct_cluster(rng)
    if r < 0.83:
        return rng.choice(_WHITESPACE)
    if r < 0.93:  # CJK ideographs, one to three
        return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
    # Latin letters with diacritics, Cyrillic, Greek: two-byte UTF-8
    base = rng.choice([0xC0, 0x410, 0x3B1])
    return "".join(chr(base + rng.randint(0, 40)) for _ in range(rng.randint(1, 4)))


def _punct_cluster(rng: random.Random) -> str:
    return "".join(rng.choice(_PUNCT + [" "]) for _ in range(rng.randint(2, 4)))


def wide_bpe_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly vocab_size tokens: the tiny models' special
    tokens (ids 0..4: BOS, EOS, roles), the 256 byte tokens, then built tokens.

    Args:
        vocab_size: total tokens (more than the 261 special and byte tokens).
        seed: the same seed gives the same tokenizer.
    """
    specials = [BOS, EOS, *ROLE_TOKENS]
    if vocab_size <= len(specials) + 256:
        raise ValueError(
            f"vocab_size={vocab_size}: must exceed the {len(specials)} special and 256 byte tokens"
        )
    byte_char = _byte_chars()
    vocab: dict[str, int] = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[byte_char[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        text = _candidate(rng)
        chars = [byte_char[b] for b in text.encode("utf-8")]
        # Enter the token through its prefixes: prefix[:i] + char[i] -> prefix[:i + 1].
        for i in range(1, len(chars)):
            left, piece = "".join(chars[:i]), "".join(chars[: i + 1])
            if piece in vocab:
                continue
            merges.append((left, chars[i]))
            vocab[piece] = len(vocab)
            if len(vocab) == vocab_size:
                break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok
