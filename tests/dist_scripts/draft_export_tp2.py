"""Under torchrun (2 procs, TP=2): load the parent's TP=1 P-EAGLE / DFlash checkpoint at TP=2, scramble the draft,
import the parent's TP=1 export -> the gathered draft equals the parent's exactly; then export the checkpoint at TP=2
(draft only, for the parent's engine target) for the parent to compare with its TP=1 export."""
import sys
from pathlib import Path

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint import load_model
from nemo_spec.export import draft_state_dict, export_checkpoint, import_draft


def main() -> None:
    work = Path(sys.argv[1])
    blob = torch.load(work / "blob.pt")
    parallel.initialize(tensor_parallel_size=2)
    model = load_model(blob["ckpt"]).eval()
    alg = blob["algorithm"]
    assert parallel.tp_size() == 2 and model.spec_config.algorithm == alg
    with torch.no_grad():
        for p in model.draft_parameters():
            p.mul_(-1.5)
    assert import_draft(model, blob["export"]) == alg
    got = draft_state_dict(model)
    bad = [k for k, v in blob["draft"].items() if not torch.equal(v, got[k])]
    assert not bad and got.keys() == blob["draft"].keys(), bad
    export_checkpoint(blob["ckpt"], work / "tp2", dtype="fp32", include_base=False, target=blob["target"])
    if parallel.is_rank_zero():
        print(f"DRAFT_EXPORT_TP2_OK {alg}")
    parallel.destroy()


if __name__ == "__main__":
    main()
