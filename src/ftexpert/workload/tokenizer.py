"""A byte-level BPE tokenizer trained on the corpus with the ``tokenizers`` library, with ChatML
special tokens and a chat template; ``tokenizer_files`` writes it as transformers expects."""
from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = (PAD, "<|im_start|>", EOS)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """The same merges for the same documents and vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return tok


def eos_ids(tok: Tokenizer) -> list[int]:
    return [tok.token_to_id(EOS), tok.token_to_id(PAD)]


def tokenizer_files(tok: Tokenizer, max_length: int) -> dict[str, str]:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
        "pad_token": PAD, "chat_template": CHAT_TEMPLATE, "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "generation_config.json": json.dumps({"eos_token_id": eos_ids(tok), "bos_token_id": None,
                                              "pad_token_id": tok.token_to_id(PAD)}, indent=2),
    }
