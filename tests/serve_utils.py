"""Test helpers for the server: a tiny BPE tokenizer trained in code, a tiny real GPT, and a live uvicorn server."""
from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch

from tests.helpers import tiny_llama

WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang in trees . "
         "we read code , write tests , fix bugs and ship fast . def main ( ) : return 0 "
         "hello world , this is a tiny model for serving tests ! numbers 1 2 3 4 5 6 7 8 9").split()

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences over a small vocabulary."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(n)]


def train_tokenizer(out_dir: Path, vocab_size: int = 128, chat_template: Optional[str] = CHAT_TEMPLATE) -> Any:
    """Train a Metaspace BPE tokenizer (HF ``tokenizers``) on :func:`corpus`, save it as a transformers dir, reload it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                  limit_alphabet=60)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    out_dir = Path(out_dir)
    fast.save_pretrained(str(out_dir))
    return AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)


def served_text(tokenizer: Any, prompt: List[int], tokens: List[int]) -> str:
    """The text a server owes for ``tokens`` generated after ``prompt``: what vLLM's detokenizer returns (tokenizers'
    ``DecodeStream`` primed with the prompt ids, vllm 0.34.0 v1/engine/detokenizer.py FastIncrementalDetokenizer).
    Not ``decode(tokens)``: a SentencePiece (Metaspace) decode drops the first token's space at the start of a text."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    return "".join(stream.step(tokenizer.backend_tokenizer, int(t)) or "" for t in tokens)


def tiny_model(tokenizer: Any, seed: int = 0, **kw: Any) -> torch.nn.Module:
    """A tiny Llama-style megatron-core GPT sized to ``tokenizer`` (weights scaled up so greedy picks are clear)."""
    from nemo_spec.models import build_gpt

    torch.manual_seed(seed)
    cfg = tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                     init_method_std=0.25, **kw)
    return build_gpt(cfg).eval()


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy (own engine and KV caches) with the same weights."""
    from nemo_spec.models import build_gpt, model_config

    torch.manual_seed(0)
    other = build_gpt(model_config(model))
    other.load_state_dict(model.state_dict())
    return other.eval()


@contextlib.contextmanager
def live_server(model: torch.nn.Module, tokenizer: Any, name: str = "tiny", api_keys: Tuple[str, ...] = (),
                admin_key: Optional[str] = None, max_queue: int = 64, batch_wait_ms: float = 20.0,
                serve: Optional[dict] = None, **spec: Any) -> Iterator[Any]:
    """A real uvicorn server on 127.0.0.1 (free port) serving ``model``; stopped on exit.
    ``serve``: further ServeConfig fields; ``spec``: ModelSpec fields."""
    from nemo_spec.serve import ModelSpec, ServeConfig
    from nemo_spec.serve.models import ModelManager
    from nemo_spec.serve.server import ServerThread

    cfg = ServeConfig(api_keys=list(api_keys), admin_key=admin_key, max_queue=max_queue,
                      batch_wait_ms=batch_wait_ms, **(serve or {}))
    manager = ModelManager(cfg.max_queue, cfg.batch_wait_ms / 1000.0)
    manager.add(ModelSpec(name=name, **spec), model=model, tokenizer=tokenizer)
    srv = ServerThread(cfg, manager).start()
    try:
        yield srv
    finally:
        srv.stop()


def poison_steps(monkeypatch: Any, tokenizer: Any, text: str = "numbers 9 9 9") -> List[int]:
    """Make the real engine's verify step raise RuntimeError("poison row") whenever a row starting with ``text``'s
    tokens is in the batch (a failure only that request causes); returns those tokens."""
    from nemo_spec.inference.engine import Engine

    poison = tokenizer(text).input_ids
    orig = Engine.verify

    def verify(self, st, *a, **kw):
        if any(s[: len(poison)] == poison for s in st.seqs):
            raise RuntimeError("poison row")
        return orig(self, st, *a, **kw)

    monkeypatch.setattr(Engine, "verify", verify)
    return poison


# Module-scoped fixtures shared by the server test modules (import them there: pytest finds imported fixtures).
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A tiny BPE tokenizer trained in the test, saved as a transformers directory."""
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    """The tokenizer of :func:`tok_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


@pytest.fixture(scope="module")
def model(tok):
    """A tiny real GPT sized to :func:`tok`."""
    return tiny_model(tok)
