"""A small byte-level BPE tokenizer with a chat template, trained offline, for the checkpoints `devmap save` writes.

There is no hub to fetch a real tokenizer from; a saved LLaMA preset gets one trained by the `tokenizers`
library on a few sentences, so that `devmap save llama-tiny DIR && devmap serve DIR` answers text on a fresh
machine. Its ids fit the model's vocabulary (<unk>, <s>, </s> are 0, 1, 2, as in LLaMA's configs), and every id
the model can produce decodes to text: the ids past the trained ones are words " t<id>" that no merge reaches, so
they never come out of encoding but a randomly initialised model's output still streams one piece per token.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>"]
_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "devmap spreads one PyTorch model over the GPUs of a machine and makes them work together.",
    "Hello! How are you today? I am fine, thank you, and you?",
    "A pipeline splits the batch into micro-batches so that every device works at the same time.",
    "user system assistant: what is the capital of France? Paris is the capital of France.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000, the numbers; (parentheses) [brackets] {braces} \"quotes\" 'apostrophes'",
]


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """Train the tokenizer (at most `vocab_size` ids) and write tokenizer.json, its config and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 4096), special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_TEXT * 4, trainer)
    tokenizer = _filled(tokenizer, vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def _filled(tokenizer: "Tokenizer", vocab_size: int) -> "Tokenizer":  # noqa: F821 (tokenizers is imported lazily)
    """The tokenizer with its BPE vocabulary filled up to `vocab_size` ids by unreachable whole words."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values())
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"\u0120t{i}"] = i  # "Ġ" is the byte-level alphabet's space
    return Tokenizer.from_str(json.dumps(spec))
