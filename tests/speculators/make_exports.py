"""EAGLE-3 drafts written by vllm-project/speculators 0.9.0's own model class and save code on CPU, with the draft
logits its own forward computes, for tests/speculators/test_speculators_import.py (``make test-speculators`` runs this
in the side environment of tests/speculators/requirements.txt, then the tests in the project's environment):

    OMP_NUM_THREADS=1 .venv-speculators/bin/python tests/speculators/make_exports.py OUT_DIR

OUT_DIR gets:
  base/                 tiny seeded HF LlamaForCausalLM (save_pretrained; weights bf16-representable)
  speculators_plain/    2 layers, reduced vocabulary 64 (d2t/t2d from speculators' build_vocab_mappings_from_
                        distribution), norm_before_residual / norm_before_fc / norm_output False (the vLLM
                        LlamaForCausalLMEagle3 math), aux ids [2, 4, 5] (vLLM numbering = 0-based outputs [1, 3, 4])
  speculators_default/  the speculators trainer's eagle3 defaults: 1 layer, full vocabulary, the three norm options
                        True (train/config/schema.py:145-148, 791-794), aux ids [1, 3, 6] (0-based outputs [0, 2, 5])
  reference.pt          {"input_ids", "base_layer_outputs", "drafts": {name: {..., "logits_ttt": [3 x [1, S-1, Vd]]}}}:
                        logits_ttt[0] is one draft pass of speculators' own forward (its lm_head output, hooked)

Each draft's weights are rounded to bf16 before the reference forward, so the bf16 files hold exactly the weights the
reference logits were computed with.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
import torch  # noqa: E402

if len(sys.argv) != 2:
    sys.exit("usage: make_exports.py OUT_DIR")
OUT = Path(sys.argv[1])
L, H, V, S = 8, 64, 128, 16  # base layers, hidden, vocab, reference sequence length
VD = 64  # reduced draft vocabulary


def bf16_exact_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def randomise_(module: torch.nn.Module, g: torch.Generator, skip=()) -> None:
    """Seeded non-trivial weights: norms 1 + 0.2 N(0,1), matrices N(0, 1/fan_in); then bf16-exact."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(s in name for s in skip):
                continue
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    bf16_exact_(module)


# ------------------------------------------------------------------------------------------------ base
def make_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      hidden_act="silu", attention_bias=False, mlp_bias=False)
    base = LlamaForCausalLM(cfg).eval()
    randomise_(base, torch.Generator().manual_seed(1))
    base.save_pretrained(OUT / "base")
    return base


@torch.no_grad()
def base_layer_outputs(base, ids: torch.Tensor) -> torch.Tensor:
    """[L, b, s, h]: the output (residual stream) of every 0-based decoder layer, via forward hooks."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).clone()))
             for layer in base.model.layers]
    base(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.stack(outs)


def capture_lm_head(module):
    got = []
    return got, module.register_forward_hook(lambda m, a, o: got.append(o.detach().float().clone()))


# ------------------------------------------------------------------------------------------------ speculators
def make_speculators(name, base, ids, layer_out, *, num_layers, aux_ids, draft_vocab, nbr, nbfc, nout):
    """speculators 0.9.0: Eagle3DraftModel.from_training_args (the path train/cli.py:build_draft_model takes),
    saved as train/checkpointer.py:339-351 does (save_pretrained of the bf16 state dict + patch_config_dtype)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.checkpointer import patch_config_dtype
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(0)
    base_dir = str(OUT / "base")
    tl = create_transformer_layer_config(verifier_name_or_path=base_dir, num_layers=num_layers, draft_arch="llama",
                                         hidden_act="silu", sliding_window=2048, full_attention_indices=[])
    d2t = t2d = None
    if draft_vocab != V:
        freq = {int(t): int(c) for t, c in enumerate(torch.randint(1, 1000, (V,), generator=torch.Generator()
                                                                   .manual_seed(7)))}
        d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, V)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=tl, t2d=t2d, d2t=d2t, verifier_name_or_path=base_dir, target_layer_ids=list(aux_ids),
        draft_vocab_size=draft_vocab, norm_before_residual=nbr, norm_before_fc=nbfc, norm_output=nout,
        ttt_steps=3, draft_attn_impl="sdpa").eval()
    # embed_tokens / verifier_* stay the verifier's (frozen in training: core.py:67-68, model.py:63-71, 206-210)
    randomise_(model, torch.Generator().manual_seed(11 + num_layers), skip=("embed_tokens", "verifier_"))
    # training batch after shift_batch (models/eagle3/data.py:28-35): row t = (x_{t+1}, g_t, position t+1)
    aux0 = [j - 1 for j in aux_ids]  # vLLM id j = hidden state entering layer j = output of 0-based layer j-1
    feats = torch.cat([layer_out[i] for i in aux0], -1)  # [1, S, 3h], blocks in the ids' order
    got, hook = capture_lm_head(model.lm_head)
    with torch.no_grad():
        tokens = model(hidden_states=feats[:, :-1], input_ids=ids[:, 1:],
                       document_ids=torch.zeros(1, S - 1, dtype=torch.long),
                       position_ids=torch.arange(1, S)[None], ttt_steps=3)
    hook.remove()
    out = OUT / name
    from speculators.train.checkpointer import convert_float_dtype  # noqa: PLC0415 (same module as the trainer's)
    model.save_pretrained(out, state_dict=convert_float_dtype(model.state_dict(), torch.bfloat16))
    patch_config_dtype(out / "config.json", torch.bfloat16)
    return {
        "tool": "speculators==0.9.0", "dir": str(out), "aux_ids_in_file": list(aux_ids),
        "aux_layers_0based_outputs": aux0, "draft_vocab_size": draft_vocab,
        "d2t": None if d2t is None else d2t.clone(), "t2d": None if t2d is None else t2d.clone(),
        "flags": {"norm_before_residual": nbr, "norm_before_fc": nbfc, "norm_output": nout,
                  "num_layers": num_layers},
        "features": feats.clone(),
        "draft_input_ids": ids[:, 1:].clone(), "draft_features": feats[:, :-1].clone(),
        "draft_position_ids": torch.arange(1, S)[None].clone(),
        "logits_ttt": got,  # list of 3 [1, S-1, Vd]; [0] = one draft pass, [1], [2] = training-time-test steps
        "draft_tokens_ttt": [t.clone() for t in tokens],
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    base = make_base()
    ids = torch.randint(3, V, (1, S), generator=torch.Generator().manual_seed(3))
    layer_out = base_layer_outputs(base, ids)
    ref = {"input_ids": ids, "base_layer_outputs": layer_out, "drafts": {}}
    ref["drafts"]["speculators_plain"] = make_speculators(
        "speculators_plain", base, ids, layer_out, num_layers=2, aux_ids=[2, 4, 5], draft_vocab=VD,
        nbr=False, nbfc=False, nout=False)
    ref["drafts"]["speculators_default"] = make_speculators(
        "speculators_default", base, ids, layer_out, num_layers=1, aux_ids=[1, 3, 6], draft_vocab=V,
        nbr=True, nbfc=True, nout=True)
    torch.save(ref, OUT / "reference.pt")
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
