"""Under torchrun (2 procs): greedy generation at TP=2 gives the TP=1 tokens for every method (and prints how many
drafted tokens each accepted)."""
import sys

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint.tp import load_full_state_dict
from nemo_spec.config import ModelConfig
from nemo_spec.inference import SamplingParams, generate
from nemo_spec.models import build_gpt
from nemo_spec.speculative import SpeculativeTransform
from tests.inference_utils import accepted_drafts


def main() -> None:
    """Rebuild every model at TP=2 from full state dicts and compare generated tokens."""
    torch.set_num_threads(1)
    blob = torch.load(sys.argv[1])
    parallel.initialize(tensor_parallel_size=2)
    cfg = ModelConfig.from_dict(blob["config"])
    target = build_gpt(cfg).eval()
    load_full_state_dict(target, blob["target"], gated=True)
    draft = build_gpt(ModelConfig.from_dict(blob["draft_config"])).eval()
    load_full_state_dict(draft, blob["draft"], gated=True)
    specs = {}
    for alg, kw in blob["spec_kw"].items():
        base = build_gpt(cfg).eval()
        spec = SpeculativeTransform(algorithm=alg, **kw)(base)
        load_full_state_dict(spec, blob["specs"][alg], gated=True)
        specs[alg] = spec.eval()
    sp = SamplingParams(max_new_tokens=blob["max_new"])
    for (method, kind), ref in blob["ref"].items():
        model = specs[kind] if kind in specs else target
        outs = generate(model, blob["prompts"], sp, method=method, draft_model=draft, options=blob["options"])
        got = [o.tokens for o in outs]
        assert got == ref, (method, kind, got, ref)
        accepted = sum(accepted_drafts(o) for o in outs)
        if torch.distributed.get_rank() == 0:
            print(f"TP2_ACCEPTED {method} {accepted}")
    if torch.distributed.get_rank() == 0:
        print(f"TP2_GEN_OK {len(blob['ref'])}")
    parallel.destroy()


if __name__ == "__main__":
    main()
