"""Under torchrun (2 procs, gloo): load TP=1 checkpoints at TP=2, write TP=2 checkpoints in every supported layout.

argv: <blob.pt with config/input_ids/logits/state_dict of the TP=1 reference> <work dir>
Prints one line ``RESULTS <json>`` on rank 0 with max abs logit errors and state-dict equality per checkpoint.
"""
import json
import re
import sys
from pathlib import Path

import torch


def main() -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from nemo_spec import parallel
    from nemo_spec.checkpoint import load_model, save_checkpoint
    from nemo_spec.checkpoint.tp import gather_full_state_dict, load_full_state_dict
    from nemo_spec.config import ModelConfig
    from nemo_spec.models import build_gpt, gpt_forward
    from tests.checkpoint_utils import (language_model_nesting, megatron_lm_args, te_names, tensor_sd,
                                        write_megatron_lm_rank, write_tracker)

    blob = torch.load(sys.argv[1])
    work = Path(sys.argv[2])
    parallel.initialize(tensor_parallel_size=2)
    rank, tp_rank = dist.get_rank(), parallel.tp_rank()
    cfg = ModelConfig.from_dict(blob["config"])
    gated = cfg.activation == "swiglu"
    x, ref_logits, ref_sd = blob["input_ids"], blob["logits"], blob["state_dict"]
    results = {}

    def check(name: str, model: torch.nn.Module, ref: dict = blob) -> None:
        model.eval()
        with torch.no_grad():
            logits = gpt_forward(model, ref["input_ids"]).logits
        g = model.nemo_spec_config.activation == "swiglu"
        full = gather_full_state_dict(model, g)
        sd = ref["state_dict"]
        results[name] = {
            "err": (logits - ref["logits"]).abs().max().item(),
            "sd_equal": set(full) == set(sd) and all(torch.equal(full[k], sd[k]) for k in sd),
            "tp": parallel.tp_size(),
        }

    # GPT-2 family (tied embeddings, learned positions, biases): TP=1 -> TP=2 and a TP=2 save
    g2 = blob["gpt2"]
    check("gpt2_tp1_dist@tp2", load_model(work / "gpt2_tp1_dist"), g2)
    g2_model = build_gpt(ModelConfig.from_dict(g2["config"]))
    load_full_state_dict(g2_model, g2["state_dict"], gated=False)
    save_checkpoint(g2_model, work / "gpt2_tp2_dist")

    # 1) TP=1 -> TP=2
    check("tp1_dist@tp2", load_model(work / "tp1_dist"))
    check("lm_legacy_tp1@tp2", load_model(work / "lm_legacy_tp1"))

    # 2) write TP=2 checkpoints from a model sharded by tp.load_full_state_dict (independent of load_model)
    fresh = build_gpt(cfg)
    load_full_state_dict(fresh, ref_sd, gated)
    save_checkpoint(fresh, work / "tp2_dist")

    local = fresh.state_dict_for_save_checkpoint()
    args = megatron_lm_args(cfg, tp=2)
    write_megatron_lm_rank(work / "lm_legacy_tp2", 7, tp_rank, local, args)
    write_megatron_lm_rank(work / "lm_te_tp2", None, tp_rank, te_names(local), args)
    write_megatron_lm_rank(work / "lm_nested_tp2", 3, tp_rank, language_model_nesting(tensor_sd(fresh)),
                           megatron_lm_args(cfg, tp=2, transformer_impl="local", use_mcore_models=False))
    dist_dir = work / "lm_dist_tp2" / "iter_0000009"
    if rank == 0:
        dist_dir.mkdir(parents=True)
    dist.barrier()
    sharded = fresh.sharded_state_dict()
    for v in sharded.values():  # TE-spec Megatron-LM names for the fused norms
        if hasattr(v, "key"):
            v.key = re.sub(r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1", v.key)
            v.key = re.sub(r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1", v.key)
    dist_checkpointing.save({"args": megatron_lm_args(cfg, tp=2, ckpt_format="torch_dist", use_dist_ckpt=True),
                             "checkpoint_version": 3.0, "iteration": 9, "model": sharded}, str(dist_dir))
    dist.barrier()
    if rank == 0:
        write_tracker(work / "lm_legacy_tp2", 7)
        write_tracker(work / "lm_te_tp2", None)
        write_tracker(work / "lm_nested_tp2", 3)
        write_tracker(work / "lm_dist_tp2", 9)
    dist.barrier()

    # 3) TP=2 -> TP=2 for every layout
    for name in ("tp2_dist", "lm_legacy_tp2", "lm_te_tp2", "lm_nested_tp2", "lm_dist_tp2"):
        check(f"{name}@tp2", load_model(work / name))

    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
