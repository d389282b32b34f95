"""Under torchrun (2 procs): Qwen3 / Qwen3-MoE / Mixtral HF dirs at TP=2 (logits == transformers'), exported again.

argv: triples (HF_DIR, BLOB with input_ids/logits, EXPORT_DIR). MoE experts are tensor-parallel (each rank holds a
shard of every expert) with the allgather token dispatcher.
"""
import sys

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint.hf import export_hf, load_hf
from nemo_spec.models import gpt_forward


def main() -> None:
    parallel.initialize(tensor_parallel_size=2)
    rank0 = torch.distributed.get_rank() == 0
    args = sys.argv[1:]
    for hf_dir, blob_path, out_dir in zip(args[0::3], args[1::3], args[2::3]):
        blob = torch.load(blob_path)
        model = load_hf(hf_dir).eval()
        with torch.no_grad():
            for fast in (True, False):
                err = (gpt_forward(model, blob["input_ids"], fast=fast).logits - blob["logits"]).abs().max().item()
                assert err < 1e-4, (hf_dir, fast, err)
        export_hf(model, out_dir)
        if rank0:
            print(f"FAMILIES_TP2_OK {hf_dir} {err:.3e}")
    parallel.destroy()


if __name__ == "__main__":
    main()
