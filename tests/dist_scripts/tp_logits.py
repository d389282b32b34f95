"""Under torchrun (2 procs): TP=2 model loaded from a full state dict gives the TP=1 logits
(through the megatron modules' forward and through the lean inference path)."""
import sys

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint.tp import gather_full_state_dict, load_full_state_dict
from nemo_spec.config import ModelConfig
from nemo_spec.models import build_gpt, gpt_forward

path = sys.argv[1]
blob = torch.load(path)
parallel.initialize(tensor_parallel_size=2)
cfg = ModelConfig.from_dict(blob["config"])
model = build_gpt(cfg)
gated = cfg.activation == "swiglu"
load_full_state_dict(model, blob["state_dict"], gated)
with torch.no_grad():
    dev = next(model.parameters()).device
    logits = gpt_forward(model, blob["input_ids"].to(dev), fast=False).logits.cpu()
    fast_logits = gpt_forward(model, blob["input_ids"].to(dev), fast=True).logits.cpu()
err = (logits - blob["logits"]).abs().max().item()
fast_err = (fast_logits - blob["logits"]).abs().max().item()
assert fast_err < 1e-4, fast_err
regathered = gather_full_state_dict(model, gated)
same = all(torch.equal(regathered[k], v) for k, v in blob["state_dict"].items())
assert logits.shape == blob["logits"].shape, logits.shape
assert err < 1e-4, err
assert same, "gathered state dict differs from the original"
if torch.distributed.get_rank() == 0:
    print(f"TP2_MAX_ERR {err:.3e}")
parallel.destroy()
