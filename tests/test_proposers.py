"""The Proposer protocol: every registered method's proposer implements it, and it covers what Session calls."""
import inspect
import re
from pathlib import Path

import pytest

from nemo_spec.inference import proposers
from nemo_spec.inference.proposers import HOOKS, METHODS, PROPOSERS, BaseProposer, Proposer, make_proposer
from nemo_spec.inference.sampling import SamplingError

INFERENCE = Path(proposers.__file__).resolve().parents[1]
MEMBERS = set(HOOKS) | {"name", "lookahead", "aux_layers", "levels"}


def test_protocol_covers_what_the_session_and_adaptive_controller_call():
    used = set()
    for f, var in (("session.py", r"self\.proposer"), ("adaptive.py", r"\bproposer")):
        used |= set(re.findall(var + r"\.(\w+)", (INFERENCE / f).read_text()))
    assert used and used <= MEMBERS, used - MEMBERS
    proto = {n for n in vars(Proposer) if not n.startswith("_")} | set(Proposer.__annotations__)
    assert proto == MEMBERS


@pytest.mark.parametrize("method", METHODS)
def test_every_registered_proposer_implements_the_protocol(method):
    cls = PROPOSERS[method]
    assert issubclass(cls, BaseProposer)
    assert isinstance(inspect.getattr_static(cls, "levels"), property)
    for hook in HOOKS:
        impl, spec = getattr(cls, hook), getattr(Proposer, hook)
        assert callable(impl)
        assert list(inspect.signature(impl).parameters) == list(inspect.signature(spec).parameters), (method, hook)
    src = inspect.getsource(inspect.getmodule(cls))
    assert "getattr(self" not in src and "hasattr(self" not in src  # state is explicit, set up in setup()


def test_model_free_proposers_are_protocol_instances():
    for method, opts in (("ar", {}), ("prompt_lookup", {"num_draft_tokens": 3})):
        p = make_proposer(method, None, None, None, opts)
        assert isinstance(p, Proposer) and p.name == method and p.levels[0] == 0
    with pytest.raises(SamplingError, match="unknown generation method"):
        make_proposer("nope", None, None, None, {})


def test_speculative_module_re_exports_the_proposers():
    from nemo_spec.inference import speculative

    for name in speculative.__all__:
        assert getattr(speculative, name) is getattr(proposers, name)


def _eagle_reference_chain(m, seq, k, skip=0):
    """The k-token greedy chain of one EAGLE draft by plain cache-free forwards: pairs (f_t, x_{t+1}) of the
    sequence (from pair ``skip`` on: the base still reads all of it), then each drafted token paired with the
    draft's own output hidden of the previous entry."""
    import torch

    from nemo_spec.models import AttnContext

    ids = torch.tensor([seq])
    with torch.no_grad():
        feats = m.fuse(m.base_features(m.base_forward(ids)))[:, :-1]
        tok, feat, chain = ids[:, 1 + skip:], feats[:, skip:], []
        for _ in range(k):
            ctx = AttnContext(position_ids=torch.arange(tok.shape[1])[None])
            hid, logits = m.draft_step(tok, feat, ctx)
            d = int(m.draft_to_base_ids(logits[0, -1].argmax()[None])[0])
            chain.append(d)
            tok = torch.cat([tok, torch.tensor([[d]])], 1)
            feat = torch.cat([feat, hid[:, -1:]], 1)
    return chain


def _trained_eagle(alg):
    """A tiny EAGLE draft trained on the target's own continuations of SLOT_REUSE_ROWS' prompts."""
    import torch

    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform
    from tests.helpers import tiny_llama
    from tests.inference_utils import SLOT_REUSE_ROWS, train_on_own_continuations
    from tests.speculative_utils import perturb_draft

    torch.manual_seed(0)
    kw = {"draft_vocab_size": 64} if alg == "eagle3" else {}
    m = SpeculativeTransform(algorithm=alg, **kw)(build_gpt(tiny_llama(num_layers=3, init_method_std=0.1)))
    if alg == "eagle3":
        m.set_draft_vocab(torch.arange(96, 0, -1).float())
    return train_on_own_continuations(perturb_draft(m, 1).eval(), [p for p, _ in SLOT_REUSE_ROWS], 40)


@pytest.mark.parametrize("alg", ["eagle1", "eagle3"])
def test_eagle_chain_is_the_plain_forwards_greedy_chain(alg):
    """Every step's EAGLE chain (ragged batch, a row taking over a finished row's slot) equals the chain of plain
    cache-free draft forwards: the drafting roots from prefill and from the catch-up after each verification,
    whose logits the proposer computes for the root rows only."""
    from tests.inference_utils import SLOT_REUSE_ROWS, accepted_drafts, recorded_proposals

    # trained on the target's own continuations, so verification accepts drafts and the catch-up runs over
    # several pairs per row
    m = _trained_eagle(alg)
    K = 3
    seen, results = recorded_proposals(m, "eagle", SLOT_REUSE_ROWS, {"num_draft_tokens": K})
    assert len(seen) >= 3 and any(seq[:3] == [7, 1, 30] for seqs, _, _ in seen for seq in seqs)
    assert sum(accepted_drafts(r) for r in results) >= 3
    for seqs, _, tokens in seen:
        for r, seq in enumerate(seqs):
            assert tokens[r].tolist() == _eagle_reference_chain(m, seq, K), seq


@pytest.mark.parametrize("extra,levels", [({}, None), ({"prefill_chunk_tokens": 2}, None),
                                          ({"prefill_chunk_tokens": 3}, [0, 3, 0, 0, 2, 3, 0])],
                         ids=["one-chunk", "chunked", "adaptive-deferred"])
def test_eagle_draft_prompt_window_reads_only_the_last_prompt_pairs(extra, levels):
    """draft_prompt_tokens=W: every step's chain equals the plain forwards' chain over the prompt's last W pairs
    (plus every generated one) — with the prompt read in one chunk, in chunks that fall wholly before the window
    or straddle it, and with adaptive speculation's deferred draft prefill; a row taking over a finished row's
    slot starts its own window; greedy output == AR; a window covering the prompt changes nothing."""
    from nemo_spec.inference import generate
    from nemo_spec.inference.sampling import SamplingParams
    from tests.inference_utils import SLOT_REUSE_ROWS, recorded_proposals

    m = _trained_eagle("eagle3")
    K, W = 3, 2
    prompts = [p for p, _ in SLOT_REUSE_ROWS]
    opts = {"num_draft_tokens": K, "draft_prompt_tokens": W, **extra}
    seen, results = recorded_proposals(m, "eagle", SLOT_REUSE_ROWS, opts, levels=levels)
    checked = 0
    for seqs, tree, tokens in seen:
        for r, seq in enumerate(seqs):
            n = tokens.shape[1]
            if n == 0:  # a plain step (adaptive chose no draft)
                continue
            prompt = next(p for p in prompts if seq[:len(p)] == p)
            assert tokens[r].tolist() == _eagle_reference_chain(m, seq, n, skip=max(0, len(prompt) - W)), seq
            checked += 1
    assert checked >= 3 and any(len(p) > W for p in prompts)
    ar = generate(m, prompts, SamplingParams(max_new_tokens=8), method="ar")
    for res, ref, (_, n) in zip(results, ar, SLOT_REUSE_ROWS):
        assert res.tokens == ref.tokens[:n]
    # a window as long as every prompt is the whole prompt: the same proposals as no window
    full, _ = recorded_proposals(m, "eagle", SLOT_REUSE_ROWS, {**opts, "draft_prompt_tokens": 6}, levels=levels)
    none, _ = recorded_proposals(m, "eagle", SLOT_REUSE_ROWS, {**opts, "draft_prompt_tokens": 0}, levels=levels)
    assert [t.tolist() for _, _, t in full] == [t.tolist() for _, _, t in none]


def test_eagle_draft_prompt_window_defaults_to_the_draft_training_length():
    """Without the option the window is SpeculativeGPT.trained_seq_len (when known): the same proposals as the
    option set to it; draft_prompt_tokens=0 reads whole prompts again; no recorded length: whole prompts."""
    from tests.inference_utils import SLOT_REUSE_ROWS, recorded_proposals

    m = _trained_eagle("eagle3")
    opts = {"num_draft_tokens": 3}

    def chains(model, o):
        seen, _ = recorded_proposals(model, "eagle", SLOT_REUSE_ROWS, o)
        return [t.tolist() for _, _, t in seen]

    whole = chains(m, opts)
    m.trained_seq_len = 2
    assert chains(m, opts) == chains(m, {**opts, "draft_prompt_tokens": 2}) != whole
    assert chains(m, {**opts, "draft_prompt_tokens": 0}) == whole


def test_eagle_draft_prompt_window_rejects_bad_values():
    from nemo_spec.inference import generate
    from nemo_spec.inference.sampling import SamplingError

    m = _trained_eagle("eagle1")
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(SamplingError, match="draft_prompt_tokens"):
            generate(m, [[5, 9, 11]], method="eagle", options={"draft_prompt_tokens": bad})
