"""Character-level tokenizer shared by every synthetic task (docs/design.md §4).

One token per character over a fixed alphabet, so the vocabulary never depends on the data and
a checkpoint's tokenizer can be rebuilt from code. Special ids are fixed because the tiny model
configs hard-code them: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3. Text with a character outside
the alphabet is refused with a ValueError naming the characters (silently mapping them to `<unk>`
would train on text the model cannot see). Dataset tasks on a built tiny model use an alphabet
made of the data's own characters (`data_alphabet`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# Digits, arithmetic and the separators the task prompts use, a space, and upper-case letters
# (task prefixes and room for future tasks). Order is part of the format: ids are positional.
ALPHABET = "0123456789+-*/()=,:>.| ABCDEFGHIJKLMNOPQRSTUVWXYZ"
VOCAB = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}


class CharTokenizer(PreTrainedTokenizerFast):
    """A character-level tokenizer that refuses text outside its alphabet instead of emitting `<unk>`."""

    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        check_alphabet(self, text)
        if args:
            check_alphabet(self, args[0])
        return super().__call__(text, *args, **kwargs)


def check_alphabet(tokenizer: PreTrainedTokenizerFast, texts: Any) -> None:
    """Raise ValueError naming the characters of `texts` that `tokenizer`'s vocabulary lacks."""
    if texts is None:
        return
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        return
    vocab = tokenizer.get_vocab()
    missing = sorted({c for t in texts for c in t if c not in vocab})
    if missing:
        example = next(t for t in texts if any(c in missing for c in t))
        raise ValueError(
            f"characters {missing} are outside the character tokenizer's alphabet (in {example[:80]!r}); "
            "use a checkpoint with its own tokenizer, or data within the alphabet"
        )


def data_alphabet(texts: Iterable[str]) -> str:
    """The sorted set of characters in `texts`, with ASCII digits and space always included."""
    chars = set("0123456789 ")
    for text in texts:
        chars.update(text)
    return "".join(sorted(chars))


def make_tokenizer(*, add_bos: bool = False, add_eos: bool = False, alphabet: str = ALPHABET) -> CharTokenizer:
    """Build the character-level tokenizer: 53 tokens, left padding, `<pad>`/`<bos>`/`<eos>` = 0/1/2.

    By default `tok(text)` returns exactly one id per character and adds no special tokens
    (callers prepend `bos_token_id` / append `eos_token_id` themselves). With `add_bos` /
    `add_eos` a post-processor adds them whenever `add_special_tokens=True` (the HF default);
    that choice is saved in `tokenizer.json` and survives `save_pretrained`/`from_pretrained`.
    """
    if len(set(alphabet)) != len(alphabet) or any(len(c) != 1 for c in alphabet):
        raise ValueError("alphabet must be distinct single characters")
    vocab = VOCAB if alphabet == ALPHABET else {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *alphabet))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # Isolate every character (spaces included) so each is looked up on its own.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate tokens without separators
    if add_bos or add_eos:
        single = " ".join([BOS_TOKEN] * add_bos + ["$A"] + [EOS_TOKEN] * add_eos)
        backend.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(BOS_TOKEN, BOS_ID), (EOS_TOKEN, EOS_ID)]
        )
    tokenizer = CharTokenizer(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.alphabet = alphabet
    return tokenizer
