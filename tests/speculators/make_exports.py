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
  peagle_llama/         P-EAGLE (PEagleDraftModel), 2 Llama layers, draft vocabulary 64, aux ids [2, 4, 5], mask 7,
                        4 depths, only the mask row of the embedding table changed
  peagle_nbr/           the same with norm_before_residual (1 layer, full vocabulary)
  peagle_default/       the speculators trainer's P-EAGLE defaults: Qwen3 layers, norm_before_residual, the whole
                        embedding table trained
  reference.pt          {"input_ids", "base_layer_outputs", "drafts": {name: {..., "logits_ttt": [3 x [1, S-1, Vd]]}},
                         "peagle": {name: {..., "anchor", "depth", "logits": [elements, Vd]}}}:
                        logits_ttt[0] is one draft pass of speculators' own forward (its lm_head output, hooked);
                        a P-EAGLE element (anchor t, depth d) predicts x_{t+d+2}

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
def layer_config_and_vocab(num_layers, arch, draft_vocab, full_attention):
    """(verifier dir, transformer_layer_config, d2t, t2d) as the speculators trainer builds them (train/cli.py): a
    draft vocabulary from a seeded token distribution (train/vocab_mapping.py) when it is smaller than the base's."""
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(0)
    base_dir = str(OUT / "base")
    tl = create_transformer_layer_config(verifier_name_or_path=base_dir, num_layers=num_layers, draft_arch=arch,
                                         hidden_act="silu", sliding_window=2048,
                                         full_attention_indices=list(range(num_layers)) if full_attention else [])
    d2t = t2d = None
    if draft_vocab != V:
        freq = {int(t): int(c) for t, c in enumerate(torch.randint(1, 1000, (V,), generator=torch.Generator()
                                                                   .manual_seed(7)))}
        d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, V)
    return base_dir, tl, d2t, t2d


def save_like_trainer(model, out):
    """As train/checkpointer.py saves (save_pretrained of the bf16 state dict + patch_config_dtype)."""
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    model.save_pretrained(out, state_dict=convert_float_dtype(model.state_dict(), torch.bfloat16))
    patch_config_dtype(out / "config.json", torch.bfloat16)


def make_speculators(name, base, ids, layer_out, *, num_layers, aux_ids, draft_vocab, nbr, nbfc, nout):
    """speculators 0.9.0: Eagle3DraftModel.from_training_args (the path train/cli.py:build_draft_model takes),
    saved as train/checkpointer.py:339-351 does (save_pretrained of the bf16 state dict + patch_config_dtype)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    base_dir, tl, d2t, t2d = layer_config_and_vocab(num_layers, "llama", draft_vocab, full_attention=False)
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
    save_like_trainer(model, out)
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


# ------------------------------------------------------------------------------------------------ P-EAGLE
MASK, DEPTHS = 7, 4  # the mask token; P-EAGLE depths 0..3


def _every_chain(seq_length, **_):
    """Replaces COD sampling (models/peagle/core.py generate_cod_sample_indices): depth 0 keeps every position,
    depth d the anchors 0 .. seq_length-1-d."""
    anchors = [torch.arange(seq_length)] + [torch.arange(seq_length - d) for d in range(1, DEPTHS)]
    return torch.cat(anchors), torch.cat([torch.full((len(a),), d, dtype=torch.long) for d, a in enumerate(anchors)])


def make_peagle(name, ids, layer_out, *, arch, num_layers, aux_ids, draft_vocab, nbr, whole_table):
    """speculators 0.9.0's PEagleDraftModel.from_training_args (train/cli.py build_draft_model), its own forward over
    every (anchor, depth) element with the lm_head output hooked, saved as its trainer saves (train/checkpointer.py)."""
    import speculators.models.peagle.core as pcore
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel

    base_dir, tl, d2t, t2d = layer_config_and_vocab(num_layers, arch, draft_vocab, full_attention=True)
    model = PEagleDraftModel.from_training_args(
        verifier_config=tl, t2d=t2d, d2t=d2t, verifier_name_or_path=base_dir, target_layer_ids=list(aux_ids),
        draft_vocab_size=draft_vocab, norm_before_residual=nbr, norm_before_fc=False, norm_output=False,
        mask_token_id=MASK, num_depths=DEPTHS, draft_attn_impl="sdpa").eval()
    g = torch.Generator().manual_seed(21 + num_layers + nbr)
    randomise_(model, g, skip=("embed_tokens", "verifier_"))
    with torch.no_grad():  # the table trains in speculators (embed_requires_grad, peagle/config.py:35-43)
        if whole_table:
            model.embed_tokens.weight.add_(0.05 * torch.randn(model.embed_tokens.weight.shape, generator=g))
        else:  # only the mask token's row learned
            model.embed_tokens.weight[MASK] = torch.randn(H, generator=g)
    bf16_exact_(model)
    feats = torch.cat([layer_out[j - 1] for j in aux_ids], -1)  # vLLM id j = output of 0-based layer j-1
    got, hook = capture_lm_head(model.lm_head)
    orig, pcore.generate_cod_sample_indices = pcore.generate_cod_sample_indices, _every_chain
    try:  # the training batch after shift_batch: row t = (x_{t+1}, g_t)
        with torch.no_grad():
            model(hidden_states=feats[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros(1, S - 1, dtype=torch.long),
                  verifier_last_hidden_states=layer_out[-1][:, 1:], num_depths=DEPTHS,
                  loss_config=resolve_loss_config("kl_div", "eager"))  # the fused default needs Triton
    finally:
        hook.remove()
        pcore.generate_cod_sample_indices = orig
    out = OUT / name
    save_like_trainer(model, out)
    anchor, depth = _every_chain(S - 1)
    return {"tool": "speculators==0.9.0", "dir": str(out), "aux_layers_0based_outputs": [j - 1 for j in aux_ids],
            "draft_vocab_size": draft_vocab, "num_layers": num_layers, "mask_token_id": MASK,
            "anchor": anchor, "depth": depth, "logits": got[0][0]}  # [elements, Vd]


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
    ref["peagle"] = {  # Llama layers as nemo_spec's; then the speculators trainer's defaults (schema.py:144-147,
        # 789-790: norm_before_residual, Qwen3 layers; the whole embedding table trained)
        "peagle_llama": make_peagle("peagle_llama", ids, layer_out, arch="llama", num_layers=2, aux_ids=[2, 4, 5],
                                    draft_vocab=VD, nbr=False, whole_table=False),
        "peagle_nbr": make_peagle("peagle_nbr", ids, layer_out, arch="llama", num_layers=1, aux_ids=[1, 3, 6],
                                  draft_vocab=V, nbr=True, whole_table=False),
        "peagle_default": make_peagle("peagle_default", ids, layer_out, arch="qwen3", num_layers=1,
                                      aux_ids=[1, 3, 6], draft_vocab=V, nbr=True, whole_table=True)}
    torch.save(ref, OUT / "reference.pt")
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
