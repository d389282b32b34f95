"""Helpers for data/training tests: a tiny BPE tokenizer trained in code and a small synthetic chat corpus."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional

FIXTURES = Path(__file__).resolve().parent / "fixtures_train"
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def synthetic_chats(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    """Small arithmetic/colour chats in normalised record form (deterministic)."""
    rng = random.Random(seed)
    out = []
    colors = ["red", "green", "blue", "yellow", "black", "white"]
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(9)
        if i % 3 == 2:
            c = rng.choice(colors)
            turns = [{"role": "user", "content": f"what color is the {c} box?"},
                     {"role": "assistant", "content": f"the {c} box is {c}. it is a {c} box."}]
        else:
            turns = [{"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}?"},
                     {"role": "assistant", "content": f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}. "
                                                      f"so the answer is {NUMBERS[a + b]}."}]
        out.append({"id": f"syn-{i}", "system": "you are helpful." if i % 2 else None, "turns": turns})
    return out


def tiny_tokenizer(out_dir: Optional[Path] = None, vocab_size: int = 128, chat_template: Optional[str] = None) -> Any:
    """Train a tiny character-BPE tokenizer (``tokenizers``) on the synthetic corpus; a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for r in synthetic_chats(200):
        texts += [t["content"] for t in r["turns"]]
    for f in FIXTURES.rglob("*"):
        if f.is_file():
            texts.append(f.read_text(encoding="utf-8", errors="replace"))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'\":;-#()[]{}<>|_/=+*")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>")
    if chat_template:
        fast.chat_template = chat_template
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def small_train_config(run_dir: Path, algorithm: str = "eagle3", steps: int = 20, **trainer_kw: Any) -> Any:
    """A TrainConfig sized for CPU tests (tiny batches, short sequences, no progress bar)."""
    from nemo_spec.config import SpeculativeConfig
    from nemo_spec.data import DataConfig
    from nemo_spec.training import OptimConfig, TrainConfig, TrainerConfig

    t = dict(max_steps=steps, train_bs=4, val_check_interval=0, ckpt_every_n_steps=0, progress_bar=False,
             acceptance_prompts=0, limit_val_batches=2)
    t.update(trainer_kw)
    return TrainConfig(run_dir=str(run_dir),
                       spec=SpeculativeConfig(algorithm=algorithm, num_medusa_heads=2, ttt_steps=2),
                       data=DataConfig(path="in-memory", max_seq_len=48, val_fraction=0.1, val_max_samples=8),
                       trainer=TrainerConfig(**t), optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2))


def parallel_draft_config(run_dir, algorithm, model_path, data, steps, **trainer_kw):
    """P-EAGLE (2 layers, 3 depths) / DFlash (2 layers over the base's first layer, blocks of 4, 6 sampled anchors)
    for a few steps: checkpoint every 2 steps, resume "auto", a tau validation at step 4 by real decoding."""
    c = small_train_config(run_dir, algorithm, steps=steps, global_batch_size=4, ckpt_every_n_steps=2,
                           val_check_interval=4, acceptance_prompts=2, acceptance_depth=3, acceptance_new_tokens=8,
                           **trainer_kw)
    c.trainer.train_bs = 2
    c.model_path, c.data.path, c.resume, c.optim.lr = str(model_path), str(data), "auto", 1e-2
    # Adam's eps 1e-8 gives gradient entries at float-noise level (~1e-9) full-size updates of either sign, so runs
    # that differ only in reduction order (TP=2 vs TP=1) would drift apart at ~lr; 1e-4 keeps them together
    c.optim.eps = 1e-4
    if algorithm == "peagle":
        c.spec.num_eagle_layers, c.spec.parallel_depth = 2, 3
    else:
        c.spec.num_eagle_layers, c.spec.block_size, c.spec.target_layer_ids, c.spec.num_anchors = 2, 4, [0], 6
    return c


def train_tiny_base(out_dir: Path, steps: int = 40) -> Path:
    """Train a tiny Llama LM on the synthetic chats (loss on all tokens); save it with its tokenizer; return path."""
    from nemo_spec.models import build_gpt
    from nemo_spec.training import train
    from tests.helpers import tiny_llama

    tok_dir = out_dir / "tokenizer_src"
    tok = tiny_tokenizer(tok_dir)
    cfg = small_train_config(out_dir / "base_run", steps=steps)
    cfg.train_base = True
    cfg.tokenizer_path = str(tok_dir)
    cfg.data.loss_on = "all"
    res = train(cfg, model_factory=lambda: build_gpt(tiny_llama(vocab_size=128)), tokenizer=tok,
                records=synthetic_chats(160, seed=1))
    return res.final_checkpoint
