"""Under torchrun (2 procs): import HF dirs at TP=2 (logits == transformers'), export them again from TP=2.

argv: BAD_DIR then triples (HF_DIR, BLOB with input_ids/logits, EXPORT_DIR). BAD_DIR has one kv head, which
TP=2 cannot shard: load_hf must refuse it before building anything.
"""
import sys

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint.hf import HFCheckpointError, export_hf, load_hf
from nemo_spec.models import gpt_forward


def main() -> None:
    parallel.initialize(tensor_parallel_size=2)
    rank0 = torch.distributed.get_rank() == 0
    try:
        load_hf(sys.argv[1])
    except HFCheckpointError as e:
        assert "config.json" in str(e) and "num_query_groups=1" in str(e), e
        if rank0:
            print("HF_TP2_BAD_TP_REJECTED")
    args = sys.argv[2:]
    for hf_dir, blob_path, out_dir in zip(args[0::3], args[1::3], args[2::3]):
        blob = torch.load(blob_path)
        model = load_hf(hf_dir).eval()
        local_vocab = model.output_layer.weight.shape[0] if model.output_layer.weight is not None \
            else model.embedding.word_embeddings.weight.shape[0]
        assert local_vocab == blob["logits"].shape[-1] // 2, local_vocab
        with torch.no_grad():
            logits = gpt_forward(model, blob["input_ids"]).logits
        err = (logits - blob["logits"]).abs().max().item()
        assert err < 1e-4, (hf_dir, err)
        export_hf(model, out_dir)
        if rank0:
            print(f"HF_TP2_OK {hf_dir} {err:.3e}")
    parallel.destroy()


if __name__ == "__main__":
    main()
