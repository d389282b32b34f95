"""Checkpoint test helpers: Megatron-LM argument namespaces and directories laid out the way Megatron-LM writes them.

Megatron-LM (megatron/training/checkpointing.py) writes, per tensor-parallel rank r,
``<root>/iter_{iteration:07d}/mp_rank_{r:02d}/model_optim_rng.pt`` holding
``{"args": Namespace, "checkpoint_version": 3.0, "iteration": it, "model": model.state_dict_for_save_checkpoint(), ...}``
and, once all ranks are done, ``<root>/latest_checkpointed_iteration.txt`` with the iteration (or "release").
With ``--ckpt-format torch_dist`` the same dict (model as ``sharded_state_dict()``) goes through
``dist_checkpointing.save`` into ``<root>/iter_{iteration:07d}/``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_spec.config import ModelConfig


def megatron_lm_args(cfg: ModelConfig, tp: int, **overrides: Any) -> argparse.Namespace:
    """A Megatron-LM argument namespace (Megatron-LM's own argument names) describing ``cfg`` at TP size ``tp``."""
    gqa = cfg.num_query_groups != cfg.num_attention_heads
    ns = argparse.Namespace(
        num_layers=cfg.num_layers, encoder_num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        group_query_attention=gqa, num_query_groups=cfg.num_query_groups if gqa else 1, kv_channels=cfg.head_dim,
        normalization=cfg.normalization, norm_epsilon=cfg.norm_eps, swiglu=cfg.activation == "swiglu",
        openai_gelu=False, squared_relu=False, bias_gelu_fusion=cfg.activation == "gelu",
        position_embedding_type="rope" if cfg.position_embedding == "rope" else "learned_absolute",
        add_position_embedding=cfg.position_embedding == "learned", rotary_base=int(cfg.rope_theta),
        rotary_percent=1.0, rotary_interleaved=False, rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False, untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        padded_vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=32,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=64,
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
        apply_residual_connection_post_layernorm=False, apply_layernorm_1p=False, qk_layernorm=False,
        num_experts=None, multi_latent_attention=False, init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        params_dtype=torch.float32, fp16=False, bf16=False, transformer_impl="local", ckpt_format="torch",
        use_dist_ckpt=False, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None, vocab_file=None,
        hidden_dropout=0.1, attention_dropout=0.1, micro_batch_size=1, global_batch_size=8, lr=3e-4,
        iteration=0, consumed_train_samples=0, use_legacy_models=False,
    )
    for k, v in overrides.items():
        setattr(ns, k, v)
    if getattr(ns, "use_mcore_models", None) is False:  # a pre-mcore-default Megatron-LM: no --use-legacy-models yet
        del ns.use_legacy_models
    return ns


def te_names(sd: Dict[str, Any]) -> Dict[str, Any]:
    """Rename our separate norms to Transformer-Engine fused names (as a TE-spec Megatron-LM model saves them)."""
    out: Dict[str, Any] = {}
    for k, v in sd.items():
        k = re.sub(r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1", k)
        k = re.sub(r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1", k)
        out[k] = v
    for k in list(out):
        m = re.match(r"^(decoder\.layers\.\d+)\.self_attention\.linear_qkv\.weight$", k)
        if m:  # TE adds fp8 metadata entries; real ones are BytesIO or tensors
            out[f"{m.group(1)}.self_attention.core_attention._extra_state"] = None
    return out


_LAYER_TO_LEGACY = [
    ("input_layernorm.", "input_norm."), ("pre_mlp_layernorm.", "post_attention_norm."),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."), ("self_attention.linear_proj.", "self_attention.dense."),
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."), ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
]


def language_model_nesting(sd: Dict[str, Any]) -> Dict[str, Any]:
    """Our GPTModel state dict in pre-mcore Megatron-LM layout (GPTModel.state_dict_for_save_checkpoint nesting)."""
    lm: Dict[str, Any] = {"embedding": {}, "encoder": {}}
    for k, v in sd.items():
        if k.endswith("_extra_state"):
            continue
        if k.startswith("embedding."):
            part = k.split(".")[1]  # word_embeddings | position_embeddings
            lm["embedding"].setdefault(part, {})[k.split(".")[-1]] = v
        elif k.startswith("decoder.final_layernorm."):
            lm["encoder"]["final_norm." + k.split(".")[-1]] = v
        elif k.startswith("decoder.layers."):
            _, _, idx, rest = k.split(".", 3)
            for a, b in _LAYER_TO_LEGACY:
                if rest.startswith(a):
                    rest = b + rest[len(a):]
                    break
            lm["encoder"][f"layers.{idx}.{rest}"] = v
        elif k == "output_layer.weight":
            lm["output_layer"] = {"weight": v}
        else:
            raise KeyError(k)
    return {"language_model": lm}


def write_megatron_lm_rank(root: Path, iteration: Optional[int], tp_rank: int, model_sd: Dict[str, Any],
                           args: argparse.Namespace, pp_rank: Optional[int] = None) -> Path:
    """Write one rank's legacy file at Megatron-LM's path (iteration None -> 'release'; pp_rank when PP > 1)."""
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_rank is None else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    d = root / ("release" if iteration is None else f"iter_{iteration:07d}") / rank_dir
    d.mkdir(parents=True, exist_ok=True)
    f = d / "model_optim_rng.pt"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration or 0, "model": model_sd,
             "rng_state": [{"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}],
             "num_floating_point_operations_so_far": 0}
    torch.save(state, f)
    return f


def pipeline_stages(sd: Dict[str, Any], bounds: List[Tuple[int, int]], tied: bool) -> List[Dict[str, Any]]:
    """Split a (TP-rank) state dict into pipeline stages as megatron-core holds them: local layer numbering,
    embedding on the first stage, final norm + output layer on the last (a copy of the embedding when tied)."""
    stages: List[Dict[str, Any]] = []
    for p, (a, b) in enumerate(bounds):
        st: Dict[str, Any] = {}
        for k, v in sd.items():
            m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", k)
            if m:
                if a <= int(m.group(1)) < b:
                    st[f"decoder.layers.{int(m.group(1)) - a}.{m.group(2)}"] = v
            elif k.startswith("embedding."):
                if p == 0:
                    st[k] = v
            elif p == len(bounds) - 1:
                st[k] = v
        if tied and p == len(bounds) - 1 and p > 0:
            st["output_layer.weight"] = sd["embedding.word_embeddings.weight"].clone()
        stages.append(st)
    return stages


def write_tracker(root: Path, iteration: Optional[int]) -> None:
    """latest_checkpointed_iteration.txt as Megatron-LM writes it (after all ranks saved)."""
    (root / "latest_checkpointed_iteration.txt").write_text("release" if iteration is None else str(iteration))


def tensor_sd(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A model's state dict without megatron's _extra_state entries (cloned, CPU)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def perturb_(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Add seeded noise to every parameter so norms/biases are not the identity (mix-ups become visible)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model


_RESHARD: Dict[str, Any] = {}


def reshard_run() -> Dict[str, Any]:
    """Once per session: TP=1 reference + checkpoints, then ckpt_reshard.py under torchrun (2 procs).

    Returns {"work": dir, "cfg", "input_ids", "logits", "state_dict", "results": per-checkpoint TP=2 results}.
    """
    if _RESHARD:
        return _RESHARD
    import atexit
    import json
    import shutil
    import tempfile

    from nemo_spec.checkpoint import save_checkpoint
    from nemo_spec.models import build_gpt, gpt_forward
    from tests.helpers import ROOT, run_torchrun, tiny_gpt2, tiny_llama

    work = Path(tempfile.mkdtemp(prefix="nemo_spec_reshard_"))
    atexit.register(shutil.rmtree, work, True)
    torch.manual_seed(0)
    cfg = tiny_llama()
    m = perturb_(build_gpt(cfg)).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = gpt_forward(m, x).logits
    sd = tensor_sd(m)
    save_checkpoint(m, work / "tp1_dist")
    write_megatron_lm_rank(work / "lm_legacy_tp1", 100, 0, m.state_dict_for_save_checkpoint(),
                           megatron_lm_args(cfg, tp=1))
    write_tracker(work / "lm_legacy_tp1", 100)
    g2_cfg = tiny_gpt2()
    g2 = perturb_(build_gpt(g2_cfg), seed=21).eval()
    with torch.no_grad():
        g2_logits = gpt_forward(g2, x).logits
    save_checkpoint(g2, work / "gpt2_tp1_dist")
    gpt2 = {"config": g2_cfg.to_dict(), "input_ids": x, "logits": g2_logits, "state_dict": tensor_sd(g2)}
    blob = work / "ref.pt"
    torch.save({"config": cfg.to_dict(), "input_ids": x, "logits": logits, "state_dict": sd, "gpt2": gpt2}, blob)
    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "ckpt_reshard.py", [blob, work], timeout=300)
    line = next(l for l in out.splitlines() if l.startswith("RESULTS "))
    _RESHARD.update(work=work, cfg=cfg, input_ids=x, logits=logits, state_dict=sd, gpt2=gpt2,
                    results=json.loads(line[len("RESULTS "):]))
    return _RESHARD
