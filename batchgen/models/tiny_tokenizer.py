"""Train the byte-level BPE tokenizer of the tiny models: on text this module writes itself (the
random-weight models), or on the text a caller gives (the trained tiny model)."""

from __future__ import annotations

import random
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

# A chat template in the usual jinja2 form: role header line, content, EOS; BOS once at the start.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_SUBJECTS = [
    "the committee",
    "our team",
    "the river",
    "a small town",
    "the new library",
    "the old engine",
    "this report",
    "the market",
    "every student",
    "the weather station",
]
_VERBS = [
    "measured",
    "described",
    "announced",
    "reviewed",
    "improved",
    "delayed",
    "summarized",
    "explained",
    "approved",
    "questioned",
]
_OBJECTS = [
    "the annual budget",
    "a rainfall record",
    "the harbor project",
    "three new bridges",
    "the survey results",
    "its energy use",
    "a longer season",
    "the reading program",
    "the price of bread",
    "a quiet morning",
]
_TAILS = [
    "after a long debate",
    "before the deadline",
    "with some surprise",
    "in great detail",
    "for the first time",
    "despite the cost",
    "on Monday",
    "by a wide margin",
    "at the last meeting",
    "without any change",
]
_EXTRA = (
    "Summarize the document in one sentence. Summary: Question: Answer: Title: Keywords: "
    "Translate extract list name date number yes no true false because however therefore "
    "0 1 2 3 4 5 6 7 8 9 10 100 2024 2025 2026 % $ , . ; : ! ? ( ) [ ] { } \" ' - _ / \\ # @ &"
)


def corpus(num_sentences: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic English-like sentences covering the demo data's vocabulary."""
    rng = random.Random(seed)
    lines = [_EXTRA]
    for _ in range(num_sentences):
        words = [rng.choice(part) for part in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS)]
        sentence = " ".join(words) + "."
        lines.append(sentence[0].upper() + sentence[1:])
    return lines


def train_tokenizer(
    vocab_size: int = 512, seed: int = 0, texts: Iterable[str] | None = None
) -> Tokenizer:
    """Byte-level BPE (every byte representable, so any UTF-8 text encodes) with BOS prepended,
    trained on `texts` (default: `corpus(seed=seed)`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed) if texts is None else texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok
