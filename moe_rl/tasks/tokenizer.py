"""Character-level tokenizer shared by every synthetic task (DESIGN §4).

One token per character over a fixed alphabet, so the vocabulary never depends on the data and
a checkpoint's tokenizer can be rebuilt from code. Special ids are fixed because the tiny model
configs hard-code them: `<pad>`=0, `<bos>`=1, `<eos>`=2; `<unk>`=3 absorbs characters outside
the alphabet (and, being special, disappears on `decode(..., skip_special_tokens=True)`).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# Digits, arithmetic and the separators the task prompts use, a space, and upper-case letters
# (task prefixes and room for future tasks). Order is part of the format: ids are positional.
ALPHABET = "0123456789+-*/()=,:>.| ABCDEFGHIJKLMNOPQRSTUVWXYZ"
VOCAB = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}


def make_tokenizer(*, add_bos: bool = False, add_eos: bool = False) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer: 53 tokens, left padding, `<pad>`/`<bos>`/`<eos>` = 0/1/2.

    By default `tok(text)` returns exactly one id per character and adds no special tokens
    (callers prepend `bos_token_id` / append `eos_token_id` themselves). With `add_bos` /
    `add_eos` a post-processor adds them whenever `add_special_tokens=True` (the HF default);
    that choice is saved in `tokenizer.json` and survives `save_pretrained`/`from_pretrained`.
    """
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token=UNK_TOKEN))
    # Isolate every character (spaces included) so each is looked up on its own.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate tokens without separators
    if add_bos or add_eos:
        single = " ".join([BOS_TOKEN] * add_bos + ["$A"] + [EOS_TOKEN] * add_eos)
        backend.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(BOS_TOKEN, BOS_ID), (EOS_TOKEN, EOS_ID)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
