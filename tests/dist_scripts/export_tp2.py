"""Under torchrun (2 procs, TP=2), for each draft algorithm:

(a) load the parent's TP=1 checkpoint at TP=2, scramble the draft, import the parent's TP=1 export -> the draft
    logits equal the parent's TP=1 logits (import splits QKV per group / gated fc1 / vocab-parallel heads);
(b) build a TP=2-native transformed model, save it at TP=2, record its draft logits, and export the checkpoint
    (loaded at TP=2, gathered for export) for the parent to check at TP=1.
"""
import sys
from pathlib import Path

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint import load_model, save_checkpoint
from nemo_spec.export import export_checkpoint, import_draft
from tests.export_utils import ALGS, make_model, our_draft_logits


def main() -> None:
    work = Path(sys.argv[1])
    blob = torch.load(work / "blob.pt")
    parallel.initialize(tensor_parallel_size=2)
    out = {}
    for alg in ALGS:
        b = blob[alg]
        # (a) import a TP=1 export at TP=2
        model = load_model(b["ckpt"]).eval()
        assert parallel.tp_size() == 2 and type(model).__name__ == "SpeculativeGPT", type(model)
        with torch.no_grad():
            for p in model.draft_parameters():
                p.mul_(-1.5)
        import_draft(model, b["export"])
        err = (our_draft_logits(model, b["ids"], b["feats"]) - b["logits"]).abs().max().item()
        assert err < 1e-5, (alg, err)
        # (b) a TP=2-native model: save at TP=2, export from the checkpoint
        native = make_model(alg, seed=5).eval()
        ckpt = save_checkpoint(native, work / f"ckpt_tp2_{alg}")
        logits = our_draft_logits(native, b["ids"], b["feats"])
        # the base's TP gather is the HF export's own business: check it once (eagle3), drafts for all
        target = {"eagle3": "vllm", "eagle1": "reference", "medusa": "reference"}[alg]
        export_checkpoint(ckpt, work / f"exp_tp2_{alg}", dtype="fp32", include_base=alg == "eagle3", target=target)
        out[alg] = {"logits": logits, "import_err": err}
    if parallel.is_rank_zero():
        torch.save(out, work / "tp2_out.pt")
        print("EXPORT_TP2_OK", {k: v["import_err"] for k, v in out.items()})
    parallel.destroy()


if __name__ == "__main__":
    main()
