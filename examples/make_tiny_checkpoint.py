"""Save a tiny Qwen3-MoE checkpoint with its own BPE tokenizer and chat template to try
`model.checkpoint=` on a CPU (a stand-in for a real pretrained MoE checkpoint).

    python examples/make_tiny_checkpoint.py          # -> examples/tiny_checkpoint/

The tokenizer is trained with `tokenizers` on `examples/word_problems.jsonl`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.models import build_model

HERE = Path(__file__).parent
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_checkpoint(data: Path, out: Path, vocab_size: int = 400) -> Path:
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        [r["question"] + " " + r["answer"] for r in rows],
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model("qwen3_moe", vocab_size=len(tokenizer), max_position_embeddings=512)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "tiny_checkpoint"
    print(make_checkpoint(HERE / "word_problems.jsonl", out))
