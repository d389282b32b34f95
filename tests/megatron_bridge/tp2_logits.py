"""Under torchrun (2 procs): a Megatron Bridge checkpoint saved at TP=1 loads at TP=2 with Bridge's own logits."""
import sys

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint import load_model
from nemo_spec.models import gpt_forward

root, ref_path, name = sys.argv[1:4]
ref = torch.load(ref_path, weights_only=False)
parallel.initialize(tensor_parallel_size=2)
model = load_model(root, tp_size=2, dtype=torch.float32).eval()
with torch.no_grad():
    err = (gpt_forward(model, ref["tokens"]).logits.float() - ref[name]["logits"]).abs().max().item()
assert err < 1e-4, err
if torch.distributed.get_rank() == 0:
    print(f"TP2_MAX_ERR {err:.3e}")
parallel.destroy()
