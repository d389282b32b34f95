"""Byte-level BPE tokenizer (HF ``tokenizers``) with special tokens and a jinja chat template.

The saved directory is a standard Hugging Face tokenizer folder (``tokenizer.json``,
``tokenizer_config.json`` with ``chat_template``, ``chat_template.jinja``, ``special_tokens_map.json``)
that ``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)`` loads offline.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Union

from nemo_spec.fsutil import default_modes

log = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS: Dict[str, str] = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
#: fixed ids 0..5, in this order
SPECIAL_TOKENS: List[str] = [PAD, BOS, EOS, *ROLE_TOKENS.values()]

#: Each turn is ``<|role|>\n{content}<|eos|>\n``; the conversation starts with ``<|bos|>``;
#: ``add_generation_prompt`` opens an assistant turn. The assistant stops by emitting ``<|eos|>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class TokenizerError(RuntimeError):
    """The tokenizer cannot be trained, saved or loaded."""


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` (specials at ids 0..5, ``<|bos|>`` prepended on encode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    min_vocab = len(SPECIAL_TOKENS) + 256
    if not isinstance(vocab_size, int) or vocab_size < min_vocab:
        raise TokenizerError(f"tokenizer vocab_size must be an int >= {min_vocab} (specials + 256 bytes), "
                             f"got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise TokenizerError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    log.info("trained byte-level BPE: vocab %d (asked %d)", tok.get_vocab_size(), vocab_size)
    return tok


def save_tokenizer(tok, out_dir: Union[str, Path], model_max_length: int = 2048) -> Path:
    """Write ``tok`` as a Hugging Face tokenizer directory (atomically: temp dir, then rename)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise TokenizerError(f"tokenizer directory {out_dir} already exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
                    "additional_special_tokens": list(ROLE_TOKENS.values())}
        added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t in SPECIAL_TOKENS}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "padding_side": "left",
            "chat_template": CHAT_TEMPLATE,
            **specials,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "special_tokens_map.json").write_text(
            json.dumps({k: v for k, v in specials.items() if v is not None}, indent=2) + "\n", encoding="utf-8")
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
        default_modes(tmp)  # mkdtemp made it 0o700
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved tokenizer to %s", out_dir)
    return out_dir


def encode_documents(tok, texts: Iterable[str], batch_size: int = 64) -> List[List[int]]:
    """Encode each text as ``<|bos|> ... <|eos|>`` token ids with a ``tokenizers.Tokenizer``."""
    eos_id = tok.token_to_id(EOS)
    out: List[List[int]] = []
    batch: List[str] = []

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=True):
            out.append(list(enc.ids) + [eos_id])
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return out
