"""vLLM 0.33.0 conformance reader for P-EAGLE drafts in the speculators format (parallel drafting).

Written from the released wheel ``vllm==0.33.0`` (``pip download --no-deps vllm==0.33.0``); line numbers are of
that wheel's files. What vLLM does with such a directory:

* config: ``speculators_model_type: "peagle"`` -> method ``eagle3`` with ``parallel_drafting=True``
  (transformers_utils/configs/speculators/base.py:133-134); the HF config is ``transformer_layer_config`` updated by
  ``update_peagle`` (speculators/algos.py:53-88): ``draft_vocab_size``, ``norm_before_residual`` (default False),
  ``norm_before_fc``, architecture ``PeagleLlamaForCausalLM`` for ``model_type`` llama (else ValueError),
  ``pard_token = mask_token_id`` (KeyError when absent), top-level ``eagle_aux_hidden_state_layer_ids``;
  ``PeagleLlamaForCausalLM`` is ``Eagle3LlamaForCausalLM`` (model_executor/models/registry.py:699);
* the mask token: ``mask_token_id`` attribute, else ``pard_token`` (v1/spec_decode/llm_base_proposer.py:355-379);
  the mask slots' hidden state is ``combine_hidden_states(mask_hidden)`` = ``fc(mask_hidden)``
  (llm_base_proposer.py:1404-1416), ``mask_hidden`` is required in the weights (llama_eagle3.py:450-455);
* the first pass lays a request out as [shifted target tokens..., bonus, pard_token x (K-1)] at positions
  start_pos + j, target hidden state j in slot j, mask slots with the mask feature (v1/spec_decode/utils.py:468-536,
  llm_base_proposer.py:918-929), one causal forward, K tokens sampled from the bonus slot and the mask slots
  (llm_base_proposer.py:628-636);
* the model: layer 0 concatenates input_layernorm(embeds) with hidden_norm(hidden) (qkv input 2h), residual the
  un-normed hidden unless ``norm_before_residual`` (llama_eagle3.py:80-160); layers >= 1 are Llama layers
  (qkv input h); final ``norm``; ``lm_head`` over the draft vocabulary scattered to the target vocabulary with
  ``d2t`` (-inf elsewhere, llama_eagle3.py:373-395); ``t2d`` skipped (llama_eagle3.py:428-429);
* embeddings: the draft's own ``embed_tokens`` when the file has it (and it differs from the target's), else the
  target's (llm_base_proposer.py:1418-1503).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, attention, mlp, read_config, read_dir, require, rms, scatter_draft_logits,
)
from nemo_spec.export.engines._eagle import layer_names

NAME = "vllm"
VERSION = "0.33.0"
FORMATS = ("peagle",)

_ARCHS = {"llama": "PeagleLlamaForCausalLM", "qwen3": "PeagleQwen3ForCausalLM"}  # speculators/algos.py:75-82


def hf_config(conf: Mapping) -> dict:
    """The HF config vLLM builds from a speculators P-EAGLE config (speculators/base.py:48-64, algos.py:53-88)."""
    if conf.get("speculators_model_type") != "peagle":
        raise EngineMismatch(f"vllm: speculators_model_type {conf.get('speculators_model_type')!r} is not 'peagle'")
    if not isinstance(conf.get("transformer_layer_config"), dict):
        raise EngineMismatch("vllm: transformer_layer_config missing or not a dict (speculators/base.py:86-93)")
    try:
        methods = conf["speculators_config"]["proposal_methods"]
        int(methods[0]["speculative_tokens"])
        conf["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError) as e:  # speculators/base.py:76-84
        raise EngineMismatch(f"vllm: invalid speculators_config structure ({e!r})") from e
    hf = dict(conf["transformer_layer_config"])
    hf["draft_vocab_size"] = conf.get("draft_vocab_size")
    hf["norm_before_residual"] = conf.get("norm_before_residual", False)
    hf["norm_before_fc"] = conf.get("norm_before_fc", False)
    model_type = hf.get("model_type", "llama")
    if model_type not in _ARCHS:
        raise EngineMismatch(f"vllm: model_type {model_type!r} unsupported for PEagle (speculators/algos.py:80-81)")
    hf["architectures"] = [_ARCHS[model_type]]
    if "mask_token_id" not in conf:
        raise EngineMismatch("vllm: config has no mask_token_id (speculators/algos.py:83 raises KeyError)")
    hf["pard_token"] = int(conf["mask_token_id"])
    if conf.get("eagle_aux_hidden_state_layer_ids"):
        hf["eagle_aux_hidden_state_layer_ids"] = list(conf["eagle_aux_hidden_state_layer_ids"])
    return hf


def speculative_tokens(draft_dir: Path, launch: Optional[Mapping[str, Any]] = None) -> int:
    """K of the first parallel-drafting pass: the launch's ``num_speculative_tokens`` (the command the export's
    README gives), else the config's ``proposal_methods[0].speculative_tokens`` (speculators/base.py:76-84)."""
    k = (launch or {}).get("num_speculative_tokens")
    if k is None:
        conf = read_config(Path(draft_dir))
        hf_config(conf)  # validates the speculators_config structure
        k = conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    if int(k) < 1:
        raise EngineMismatch(f"vllm: num_speculative_tokens={k} < 1")
    return int(k)


def peagle_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Draft logits [b, s-1+k-1, V] of vLLM's first parallel-drafting pass for context ``ids`` [b, s]: the pairs
    (f_t, ids[t+1]) at positions t (the last one holds the bonus token ids[s-1]) then k-1 mask slots at positions
    s-1 .. s+k-3. vLLM samples rows s-2 .. s+k-3; every row is returned (the forward computes them all)."""
    draft_dir = Path(draft_dir)
    conf = read_config(draft_dir)
    hf = hf_config(conf)
    if hf["architectures"][0] != "PeagleLlamaForCausalLM":
        raise EngineMismatch(f"vllm: {hf['architectures'][0]} is not modelled by this reader (llama only)")
    w = {kk: v for kk, v in read_dir(draft_dir, ["model.safetensors"]).items() if kk != "t2d"}
    L = base.num_layers
    vocab = int(hf["vocab_size"])
    vd = int(hf.get("draft_vocab_size") or vocab)  # llama_eagle3.py:310-316
    h = int(hf["hidden_size"])
    # llama_eagle3.py:209-221: fc width = target_hidden_size * num_aux, num_aux from num_aux_hidden_states or
    # eagle_config's ids (the speculators top-level key does not count), default 3
    num_aux = hf.get("num_aux_hidden_states")
    if num_aux is None:
        num_aux = len((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []) or 3
    fc_in = int(hf.get("target_hidden_size", h)) * int(num_aux)
    ids_cfg = hf.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]  # model default (interfaces.py)
    captured = sorted(set(ids_cfg))  # interfaces.py:1616-1617
    if captured[0] < 0 or captured[-1] > L:
        raise EngineMismatch(f"vllm: aux ids {ids_cfg} outside [0, {L}] (llama.py:428-441)")
    if "fc.weight" not in w or tuple(w["fc.weight"].shape) != (h, fc_in):
        raise EngineMismatch(f"vllm: fc.weight must be [{h}, {fc_in}] (llama_eagle3.py:209-250), got "
                             f"{tuple(w['fc.weight'].shape) if 'fc.weight' in w else None}")
    if len(captured) * base.stream[0].shape[-1] != fc_in:
        raise EngineMismatch(f"vllm: aux ids {ids_cfg} capture {len(captured)} distinct hidden states but fc "
                             f"expects {num_aux} (shape error at run time)")
    if "mask_hidden" not in w:  # llama_eagle3.py:450-455
        raise EngineMismatch("vllm: mask_hidden not in the weights but the model is configured for parallel drafting")
    if w["mask_hidden"].numel() != fc_in:  # copied into a [1, fc_input_size] buffer (llama_eagle3.py:347-354, 440)
        raise EngineMismatch(f"vllm: mask_hidden has {w['mask_hidden'].numel()} values, the buffer {fc_in}")
    if "d2t" in w and vd == vocab:
        raise EngineMismatch("vllm: d2t stored for a full-vocabulary draft: no draft_id_to_target_id parameter, the "
                             "loader raises (llama_eagle3.py:338-345)")
    qkv_bias = bool(hf.get("attention_bias", False))  # llama_eagle3.py:84-96
    n = int(hf["num_hidden_layers"])
    need = ["fc.weight", "norm.weight", "lm_head.weight", "mask_hidden"]
    for i in range(n):
        need += layer_names(f"layers.{i}.", "hidden_norm" if i == 0 else None, qkv_bias=qkv_bias, o_bias=qkv_bias)
    if vd != vocab:
        need.append("d2t")
    if hf.get("norm_before_fc"):
        need.append("input_norm.weight")  # llama_eagle3.py:225-231
    require(w, need, "vllm", "parameters the draft builds but the file lacks (load_weights checks nothing)")
    known = set(need) | {"embed_tokens.weight"} | {f"layers.{i}.hidden_norm.weight" for i in range(n)}
    unknown = sorted(kk for kk in w if kk not in known and not kk.endswith(".bias"))
    if unknown:
        raise EngineMismatch(f"vllm: no parameter for {unknown[:5]} (AutoWeightsLoader raises, utils.py:440-448)")
    eps = float(hf["rms_norm_eps"])
    hd = int(hf.get("head_dim") or h // hf["num_attention_heads"])
    b, s = ids.shape
    table = w["embed_tokens.weight"] if "embed_tokens.weight" in w else base.embed
    mask_tok = int(hf.get("mask_token_id", hf["pard_token"]))  # llm_base_proposer.py:365-370
    tokens = torch.cat([ids[:, 1:], torch.full((b, k - 1), mask_tok, dtype=ids.dtype)], 1)
    emb = table[tokens]

    def combine(x: torch.Tensor) -> torch.Tensor:  # combine_hidden_states, llama_eagle3.py:397-418
        if hf.get("norm_before_fc"):
            x = rms(x, w["input_norm.weight"], eps)
        return x @ w["fc.weight"].T

    feat = combine(torch.cat([base.stream[j] for j in captured], -1)[:, :-1])
    mfeat = combine(w["mask_hidden"].reshape(1, 1, -1))
    x = torch.cat([feat, mfeat.expand(b, k - 1, -1)], 1)
    p = "layers.0."
    normed = rms(x, w[p + "hidden_norm.weight"], eps)
    residual = normed if hf.get("norm_before_residual") else x  # llama_eagle3.py:101-122
    a = torch.cat([rms(emb, w[p + "input_layernorm.weight"], eps), normed], -1)
    hid = residual + attention(a, w, p, hf, hd, qkv_bias, qkv_bias)  # causal over the block (positions 0..)
    hid = hid + mlp(rms(hid, w[p + "post_attention_layernorm.weight"], eps), w, p)
    for i in range(1, n):
        p = f"layers.{i}."
        hid = hid + attention(rms(hid, w[p + "input_layernorm.weight"], eps), w, p, hf, hd, qkv_bias, qkv_bias)
        hid = hid + mlp(rms(hid, w[p + "post_attention_layernorm.weight"], eps), w, p)
    logits = rms(hid, w["norm.weight"], eps) @ w["lm_head.weight"].T
    base_ids = (torch.arange(vd) + w["d2t"].long()) if vd != vocab else None
    return scatter_draft_logits(logits, base_ids, vocab)


def our_peagle_logits(model: torch.nn.Module, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The checkpoint's own draft logits in :func:`peagle_logits`' layout (base vocabulary, -inf outside)."""
    from nemo_spec.models import AttnContext

    b, s = ids.shape
    draft = model.eagle_module
    with torch.no_grad():
        out = model.base_forward(ids)
        feats = model.fuse(model.base_features(out))[:, :-1]
        tok = torch.cat([ids[:, 1:], torch.full((b, k - 1), draft.mask_token_id, dtype=ids.dtype)], 1)
        feat = torch.cat([feats, draft.mask_feature()[None, None].expand(b, k - 1, -1)], 1)
        ctx = AttnContext(position_ids=torch.arange(s - 1 + k - 1)[None].expand(b, -1))
        logits = model.draft_step(tok, feat, ctx)[1].float()
    if logits.shape[-1] != model.model_config.vocab_size:
        logits = scatter_draft_logits(logits, draft.base_ids_of_draft_vocab().cpu(), model.model_config.vocab_size)
    return logits
