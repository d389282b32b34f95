"""Real NVIDIA Model Optimizer (nvidia-modelopt 0.47.0) speculative-decoding exports on CPU, with references from
ModelOpt's own forward, for tests/modelopt/test_modelopt_import.py (``make test-modelopt`` runs this in the side
environment built from tests/modelopt/requirements.txt, then the tests in the project's own environment):

    OMP_NUM_THREADS=1 .venv-modelopt/bin/python tests/modelopt/make_exports.py OUT_DIR

Everything below calls ModelOpt's own code, unpatched: ``mtsp.convert`` (HFEagleModel.modify / HFMedusaModel.modify),
``calibrate_frequent_vocab`` + ``HFEagleModel.load_draft_vocab_cache`` for d2t, ``HFEagleModel._eagle_forward`` /
``pseudo_speculative_generate`` for reference drafts, ``export_speculative_decoding`` (EagleExporter) and
``export_hf_checkpoint`` for the files.

OUT_DIR gets:
  base/            tiny random LlamaForCausalLM (save_pretrained)
  eagle3_1l_full/  EAGLE-3, 1 layer, full vocab (no d2t; lm_head = a copy of the base's), ModelOpt's default aux ids
  eagle3_1l_d2t/   EAGLE-3, 1 layer, draft vocab 64 (d2t from ModelOpt's calibrate_frequent_vocab), aux [0, 2, 4]
  eagle3_2l_d2t/   EAGLE-3, 2 layers, draft vocab 64, aux [1, 3, 7] (7 = the last layer: its pre-final-norm output)
  eagle3_1l_yarn/  eagle3_1l_full's weights with ModelOpt's default eagle_export_rope_scaling (YaRN x32 written into
                   config.json although the draft was trained with plain RoPE)
  medusa/, medusa_2l/  whole-model export_hf_checkpoint with medusa_heads.* (3 heads x 1 block, 2 heads x 2 blocks)
  reference.pt     per variant: ModelOpt's own draft logits (``modelopt_*``), and the same draft computed from the
                   exported tensors with vLLM/SGLang's layer-0 norm (``serving_*``: hidden_norm only; ModelOpt 0.47's
                   HF EagleModule also applies input_layernorm to the fused feature first, checked here against its
                   own forward to 1e-4)
"""
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

T0 = time.time()
torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import modelopt  # noqa: E402
import modelopt.torch.speculative as mtsp  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint, export_speculative_decoding  # noqa: E402
from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel  # noqa: E402
from modelopt.torch.speculative.utils import calibrate_frequent_vocab  # noqa: E402

if len(sys.argv) != 2:
    sys.exit("usage: make_exports.py OUT_DIR")
OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)

VOCAB, H, HEADS, KV, HD, FFN, LAYERS, EPS, THETA = 128, 64, 4, 2, 16, 128, 8, 1e-5, 10000.0
DRAFT_VOCAB = 64
STEPS = 3  # pseudo_speculative_generate draft steps

# ------------------------------------------------------------------ base
torch.manual_seed(0)
base_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD, rms_norm_eps=EPS,
                       max_position_embeddings=256, rope_theta=THETA, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
base_cfg._attn_implementation = "sdpa"
base = LlamaForCausalLM(base_cfg).eval()
with torch.no_grad():  # HF init is N(0, 0.02): too flat for a meaningful argmax; scale everything up a bit
    g = torch.Generator().manual_seed(1)
    for n, p in base.named_parameters():
        if n.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.08 * torch.randn(p.shape, generator=g))
base.save_pretrained(OUT / "base")

g_ids = torch.Generator().manual_seed(2)
INPUT_IDS = torch.randint(3, VOCAB, (2, 10), generator=g_ids)  # two prompts, 10 tokens each

with torch.no_grad():
    base_out = base(input_ids=INPUT_IDS, output_hidden_states=True)
BASE_HIDDEN = torch.stack(base_out.hidden_states)  # [L+1, B, T, H]; [0] = embeddings, [L] is AFTER the final norm
_outs = []
_hooks = [layer.register_forward_hook(lambda m, i, o: _outs.append(o if torch.is_tensor(o) else o[0]))
          for layer in base.model.layers]
with torch.no_grad():
    base(input_ids=INPUT_IDS)
for _h in _hooks:
    _h.remove()
BASE_LAYER_OUT = torch.stack(_outs)  # [L, B, T, H]: raw output of decoder layer i (pre final norm)
assert torch.allclose(BASE_LAYER_OUT[:-1], BASE_HIDDEN[1:-1])
BASE_LOGITS = base_out.logits

reference = {"_meta": {
    "modelopt": modelopt.__version__, "transformers": transformers.__version__, "torch": str(torch.__version__),
    "input_ids": INPUT_IDS, "base_logits": BASE_LOGITS, "base_hidden_states": BASE_HIDDEN,
    "base_layer_outputs": BASE_LAYER_OUT,
    "notes": "base_layer_outputs[i] = raw output of decoder layer i = what ModelOpt's aux hook on layers[i] captures; "
             "HF base_hidden_states[i+1] equals it except for the last layer, where HF returns the final-normed state",
}}


def perturb_draft(module, seed):
    """Non-trivial draft weights: norms exp(0.5 N) (far from 1, so the double norm matters), matrices += 0.05 N."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.exp(0.5 * torch.randn(p.shape, generator=g)))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


class StubTokenizer:
    """Duck-typed tokenizer for ModelOpt's calibrate_frequent_vocab (it only calls apply_chat_template)."""

    def apply_chat_template(self, conversations, **kw):
        return [t for c in conversations for t in c["ids"]]


# ------------------------------------------------------------------ hand-written draft (serving semantics)
def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(T, hd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    e = torch.cat([f, f], -1)
    return e.cos(), e.sin()


def rot_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def attn(sd, p, x, cfg):
    B, T, _ = x.shape
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (x @ sd[p + "q_proj.weight"].T).view(B, T, nh, hd).transpose(1, 2)
    k = (x @ sd[p + "k_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
    v = (x @ sd[p + "v_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
    cos, sin = rope(T, hd, THETA)
    q, k = q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = (q @ k.transpose(-1, -2)) / hd ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * hd)
    return o @ sd[p + "o_proj.weight"].T


def mlp(sd, p, x):
    return (torch.nn.functional.silu(x @ sd[p + "gate_proj.weight"].T) * (x @ sd[p + "up_proj.weight"].T)) \
        @ sd[p + "down_proj.weight"].T


def hand_draft(sd, cfg, feat, emb, double_norm):
    """EAGLE-3 draft from exported tensors. feat = fc(aux) (or a fed-back prenorm hidden), emb = embeddings.

    double_norm=False: vLLM / SGLang / EAGLE-3 reference: layer 0 attention input = cat(in_ln(emb), hidden_norm(feat)).
    double_norm=True : ModelOpt 0.47 HF EagleModule: LlamaDecoderLayer applies input_layernorm to feat first, then the
                       pre-hook does cat(in_ln(emb), hidden_norm(in_ln(feat))).  Residual is feat in both.
    Returns (logits, postnorm_h, prenorm_h)."""
    eps = cfg["rms_norm_eps"]
    h = feat
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        ln = sd[p + "input_layernorm.weight"]
        if i == 0:
            f = rms(h, ln, eps) if double_norm else h
            x = torch.cat([rms(emb, ln, eps), rms(f, sd[p + "hidden_norm.weight"], eps)], -1)
        else:
            x = rms(h, ln, eps)
        h = h + attn(sd, p + "self_attn.", x, cfg)
        h = h + mlp(sd, p + "mlp.", rms(h, sd[p + "post_attention_layernorm.weight"], eps))
    post = rms(h, sd["norm.weight"], eps)
    return post @ sd["lm_head.weight"].T, post, h


def hand_generate(sd, cfg, feat0, embed_w, eagle_ids, steps, double_norm):
    """Same loop as HFEagleModel.pseudo_speculative_generate, on the hand-written draft."""
    d2t = sd.get("d2t")
    feat, ids, toks = feat0, eagle_ids, []
    for _ in range(steps):
        logits, _, pre = hand_draft(sd, cfg, feat, embed_w[ids], double_norm)
        t = logits[:, -1:].argmax(-1)
        if d2t is not None:
            t = t + d2t[t]
        toks.append(t)
        ids = torch.cat([ids, t], -1)
        feat = torch.cat([feat, pre[:, -1:]], 1)
    return torch.cat(toks, -1)


# ------------------------------------------------------------------ EAGLE-3 variants
def eagle_variant(name, layers, draft_vocab, aux_ids, export_rope_scaling, seed):
    t = time.time()
    model = copy.deepcopy(base)
    arch = {  # merged by ModelOpt over eagle3_default_config (use_aux_hidden_state, use_last_layernorm = True)
        "num_hidden_layers": layers, "intermediate_size": FFN, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": EPS, "rope_theta": THETA,
        "rope_scaling": {"rope_type": "default", "rope_theta": THETA},
    }
    if draft_vocab is not None:
        arch["draft_vocab_size"] = draft_vocab
    if aux_ids is not None:
        arch["eagle_aux_hidden_state_layer_ids"] = aux_ids
    cfg = {"eagle_decoder_type": "llama", "eagle_architecture_config": arch,
           "eagle_use_torch_compile": False}  # default True: torch.compile(mode=max-autotune) of the draft
    if export_rope_scaling is not None:
        cfg["eagle_export_rope_scaling"] = export_rope_scaling
    torch.manual_seed(seed)
    mtsp.convert(model, [("eagle", cfg)])
    model.eval()
    perturb_draft(model.eagle_module, seed + 100)

    if draft_vocab is not None and draft_vocab < VOCAB:
        # ModelOpt's own d2t path: calibrate_frequent_vocab(tokenizer, conversations) -> torch.save -> load_draft_vocab_cache
        g = torch.Generator().manual_seed(seed + 200)
        weights = torch.rand(VOCAB, generator=g) ** 3  # skewed, distinct frequencies
        counts = (weights * 1000).long() + torch.randperm(VOCAB, generator=g)  # no ties among the top
        ids = [i for i in range(VOCAB) for _ in range(int(counts[i]))]
        d2t_path = OUT / f"{name}.d2t.pt"
        calibrate_frequent_vocab(StubTokenizer(), [{"ids": ids}], draft_vocab, output_file=str(d2t_path))
        HFEagleModel.load_draft_vocab_cache(model, str(d2t_path))
        d2t_path.unlink()

    export_speculative_decoding(model, export_dir=OUT / name)

    # ---- references with ModelOpt's own forward
    with torch.no_grad():
        out = super(HFEagleModel, model).forward(input_ids=INPUT_IDS, output_hidden_states=True)  # as ModelOpt does
        aux = model.pop_and_gather_aux_hiddens()  # ModelOpt's hooks, concatenated in aux-id order
        base_token = out.logits[:, -1:].argmax(-1)
        eagle_ids = torch.cat([INPUT_IDS[:, 1:], base_token], -1)  # embeddings shifted left by one (EAGLE pairing)
        emb = model._base_model_embeddings(eagle_ids)
        feat = model.eagle_module.fc(aux)
        model.eagle_module._maybe_init_rope(device=feat.device)
        mask = model._prepare_decoder_attention_mask(None, eagle_ids.shape, 0, feat.device, feat.dtype)
        post, pre, logits, _ = model._eagle_forward(feat, emb, mask, None)
        mo_base_tok, mo_draft = model.pseudo_speculative_generate(INPUT_IDS, steps=STEPS)
        assert torch.equal(mo_base_tok, base_token)

        # ---- hand-written draft from the EXPORTED files
        sd = load_file(str(OUT / name / "model.safetensors"))
        ecfg = json.loads((OUT / name / "config.json").read_text())
        h_feat = aux @ sd["fc.weight"].T
        hl_dbl, hpost_dbl, hpre_dbl = hand_draft(sd, ecfg, h_feat, base.model.embed_tokens.weight[eagle_ids], True)
        hl_srv, hpost_srv, hpre_srv = hand_draft(sd, ecfg, h_feat, base.model.embed_tokens.weight[eagle_ids], False)
        err = (hl_dbl - logits).abs().max().item()
        assert err < 1e-4, f"hand-written double-norm draft != ModelOpt forward ({err})"
        srv_draft = hand_generate(sd, ecfg, h_feat, base.model.embed_tokens.weight, eagle_ids, STEPS, False)
        dbl_draft = hand_generate(sd, ecfg, h_feat, base.model.embed_tokens.weight, eagle_ids, STEPS, True)
        assert torch.equal(dbl_draft, mo_draft), (dbl_draft, mo_draft)

    aux_layer_ids = list(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    ref = {
        "aux_layer_ids": aux_layer_ids,
        "aux_hidden_states": aux,                    # [B,T,n*H] = cat(base_hidden_states[i+1] for i in aux ids)
        "eagle_ids": eagle_ids,                      # input_ids[:,1:] + base argmax token: ids whose embeddings pair with aux
        "input_embeds": emb,                         # base embed_tokens(eagle_ids)
        "fused_feature": feat,                       # fc(aux_hidden_states)
        "base_token": base_token,
        "d2t": sd.get("d2t"),
        # ModelOpt 0.47 semantics (double norm on layer 0 feature) -- from ModelOpt's own EagleModule forward
        "modelopt_logits": logits,                   # [B,T,draft_vocab]
        "modelopt_postnorm_hidden": post,
        "modelopt_prenorm_hidden": pre,
        "modelopt_draft_tokens": mo_draft,           # pseudo_speculative_generate(steps=3), target-vocab ids
        # serving semantics (vLLM/SGLang: hidden_norm only) -- hand-written from the exported tensors
        "serving_logits": hl_srv,
        "serving_postnorm_hidden": hpost_srv,
        "serving_prenorm_hidden": hpre_srv,
        "serving_draft_tokens": srv_draft,           # same loop as pseudo_speculative_generate, serving semantics
        "serving_vs_modelopt_max_abs_logit_diff": (hl_srv - logits).abs().max().item(),
        "hand_double_norm_vs_modelopt_max_abs_err": err,
    }
    assert torch.allclose(aux, torch.cat([BASE_LAYER_OUT[i] for i in aux_layer_ids], -1), atol=1e-6)
    print(f"[{name}] aux ids {aux_layer_ids}; hand(double) vs ModelOpt {err:.2e}; serving vs ModelOpt logits "
          f"{ref['serving_vs_modelopt_max_abs_logit_diff']:.3f}; modelopt draft {mo_draft.tolist()} serving "
          f"{srv_draft.tolist()}; {time.time() - t:.1f}s")
    return ref


reference["eagle3_1l_full"] = eagle_variant("eagle3_1l_full", 1, None, None, {}, seed=10)
reference["eagle3_1l_d2t"] = eagle_variant("eagle3_1l_d2t", 1, DRAFT_VOCAB, [0, 2, 4], {}, seed=20)
reference["eagle3_2l_d2t"] = eagle_variant("eagle3_2l_d2t", 2, DRAFT_VOCAB, [1, 3, 7], {}, seed=30)
# ModelOpt's default export (eagle_export_rope_scaling left at its default: yarn x32 written into config.json)
reference["eagle3_1l_yarn"] = eagle_variant("eagle3_1l_yarn", 1, None, None, None, seed=10)


# ------------------------------------------------------------------ Medusa
def medusa_variant(name, heads, layers, seed):
    t = time.time()
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    mtsp.convert(model, [("medusa", {"medusa_num_heads": heads, "medusa_num_layers": layers})])
    model.eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # ResBlock linears are zero-initialised by ModelOpt: make them non-trivial
        for p in model.medusa_heads.parameters():
            p.add_((0.05 if p.ndim == 2 else 0.02) * torch.randn(p.shape, generator=g))
        out = model(input_ids=INPUT_IDS)  # HFMedusaModel.forward
    export_hf_checkpoint(model, export_dir=OUT / name)
    medusa_logits = torch.stack(out.medusa_logits)  # [heads,B,T,V]; head k predicts token t+k+2
    assert torch.allclose(out.logits, BASE_LOGITS, atol=1e-5)
    # hand check from the exported file: head k = W_k @ ResBlock^n(h), ResBlock(x) = x + silu(A x + b)
    sd = load_file(str(OUT / name / "model.safetensors"))
    h_final = base_out.hidden_states[-1]
    for k in range(heads):
        x = h_final
        for j in range(layers):
            x = x + torch.nn.functional.silu(x @ sd[f"medusa_heads.{k}.{j}.linear.weight"].T
                                             + sd[f"medusa_heads.{k}.{j}.linear.bias"])
        err = (x @ sd[f"medusa_heads.{k}.{layers}.weight"].T - medusa_logits[k]).abs().max().item()
        assert err < 1e-4, (k, err)
    print(f"[{name}] {time.time() - t:.1f}s")
    return {"medusa_logits": medusa_logits, "base_logits": out.logits,
            "final_hidden": base_out.hidden_states[-1],  # post final-norm (what the heads read)
            "num_heads": heads, "num_layers": layers}


reference["medusa"] = medusa_variant("medusa", 3, 1, seed=40)
reference["medusa_2l"] = medusa_variant("medusa_2l", 2, 2, seed=50)

torch.save(reference, OUT / "reference.pt")

print(f"done in {time.time() - T0:.1f}s -> {OUT}")
