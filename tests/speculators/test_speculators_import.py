"""EAGLE-3 and P-EAGLE drafts written by vllm-project/speculators (the Hub's ``*-speculator.eagle3`` format) load with
``import_draft``: files its own save code wrote (tests/speculators/make_exports.py, speculators 0.9.0 in its side
environment) give its own forward's draft logits, with the speculators trainer's draft options too; a draft whose options
or layers are not the model's is refused by name rather than imported as another function.

Runs with ``make test-speculators`` (which builds the files and points NEMO_SPEC_SPECULATORS_EXPORTS at them); skipped
otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nemo_spec.checkpoint import load_model
from nemo_spec.export import ExportError, detect_draft_format, import_draft
from nemo_spec.speculative import SpeculativeTransform

EXPORTS = os.environ.get("NEMO_SPEC_SPECULATORS_EXPORTS")
pytestmark = pytest.mark.skipif(not EXPORTS, reason="speculators drafts not built: run make test-speculators")


@pytest.fixture(scope="module")
def ref():
    torch.set_num_threads(1)
    return torch.load(Path(EXPORTS) / "reference.pt", weights_only=False)


def _model(d, **kw):
    vd, flags = d["draft_vocab_size"], d["flags"]
    base = load_model(str(Path(EXPORTS) / "base"), dtype=torch.float32)
    options = {k: flags[k] for k in ("norm_before_fc", "norm_before_residual", "norm_output")}
    options.update(kw.pop("options", {}))
    return SpeculativeTransform(algorithm="eagle3", num_eagle_layers=flags["num_layers"],
                                aux_layers=kw.get("aux_layers", d["aux_layers_0based_outputs"]),
                                draft_vocab_size=None if vd == 128 else vd, **options)(base).eval()  # base vocab: 128


@pytest.mark.parametrize("name", ["speculators_plain", "speculators_default"])
def test_speculators_drafts_import_with_their_own_logits(ref, name):
    """speculators_plain: 2 layers, reduced vocabulary, vLLM ids [2, 4, 5]; speculators_default: its trainer's
    defaults (norm_before_fc, norm_before_residual, norm_output), ids [1, 3, 6]. Imported, the draft gives speculators'
    own forward's logits, on nemo_spec's generation path (no gradients) and its training path alike."""
    d = ref["drafts"][name]
    assert detect_draft_format(Path(EXPORTS) / name) == "eagle3"
    m = _model(d)
    assert import_draft(m, Path(EXPORTS) / name) == "eagle3"
    if d["d2t"] is not None:
        assert torch.equal(m.eagle_module.d2t.cpu(), d["d2t"].long())
    with torch.no_grad():
        # our base's features are the tool's (hooked layer outputs of the same HF base)
        feats = m.base_features(m.base_forward(ref["input_ids"]))
        assert (feats - d["features"]).abs().max() < 1e-4
        logits = m.draft_step(d["draft_input_ids"], m.fuse(d["draft_features"]))[1].float()
    assert (logits - d["logits_ttt"][0]).abs().max() < 1e-4
    with torch.enable_grad():
        train = m.draft_step(d["draft_input_ids"], m.fuse(d["draft_features"]))[1].float()
    assert (train - d["logits_ttt"][0]).abs().max() < 1e-4
    # the later training-time-test steps read each step's output as the next feature (norm_output: the normalised
    # one): nemo_spec's TTT logits equal speculators' own for every step (rows whose targets exist at that step)
    from nemo_spec.speculative.losses import eagle3_losses

    ids = ref["input_ids"]
    with torch.no_grad():
        res = eagle3_losses(m, ids, torch.ones_like(ids), m.base_forward(ids), ttt_steps=3, return_logits=True)
    s = ids.shape[1]
    for i, lg in enumerate(res["step_logits"]):
        lg = lg.float().transpose(0, 1) if lg.shape[0] == s else lg.float()
        n = s - 2 - i
        assert (lg[:, :n] - d["logits_ttt"][i].float()[:, :n]).abs().max() < 1e-4, (name, i)


def test_other_layers_or_options_are_refused_by_name(ref):
    d = ref["drafts"]["speculators_plain"]
    with pytest.raises(ExportError, match=r"reads base layers \[1, 3, 4\].*aux_layers=\[1, 3, 4\]"):
        import_draft(_model(d, aux_layers=[0, 3, 4]), Path(EXPORTS) / "speculators_plain")
    d = ref["drafts"]["speculators_default"]  # imported without its options it was another function (1.79)
    with pytest.raises(ExportError, match="trained with norm_before_fc=True, norm_before_residual=True, "
                                          "norm_output=True, this model's draft with"):
        import_draft(_model(d, options=dict(norm_before_fc=False, norm_before_residual=False, norm_output=False)),
                     Path(EXPORTS) / "speculators_default")


def _peagle_model(d):
    base = load_model(str(Path(EXPORTS) / "base"), dtype=torch.float32)
    vd = d["draft_vocab_size"]
    return SpeculativeTransform(algorithm="peagle", num_eagle_layers=d["num_layers"], parallel_depth=4,
                                aux_layers=d["aux_layers_0based_outputs"], mask_token_id=d["mask_token_id"],
                                draft_vocab_size=None if vd == 128 else vd)(base).eval()


@torch.no_grad()
def _peagle_logits(m, ids, anchor, depth):
    """nemo_spec's P-EAGLE draft on speculators' elements: (anchor t, depth d) = one causal draft forward over the
    pairs (x_{j+1}, f_j), j <= t, at positions 0..t, then d mask slots (mask_hidden, mask_token_id); its last row."""
    from nemo_spec.models import AttnContext

    d_ = m.eagle_module
    fused = m.fuse(m.base_features(m.base_forward(ids)))
    mask_feature = d_.mask_feature()
    rows = []
    for t, k in zip(anchor.tolist(), depth.tolist()):
        tok = torch.cat([ids[:, 1:t + 2], torch.full((1, k), d_.mask_token_id, dtype=ids.dtype)], 1)
        feat = torch.cat([fused[:, :t + 1], mask_feature[None, None].expand(1, k, -1)], 1)
        rows.append(m.draft_step(tok, feat, AttnContext(position_ids=torch.arange(t + 1 + k)[None]))[1][0, -1].float())
    return torch.stack(rows)


def test_speculators_peagle_drafts_import_with_their_own_logits(ref):
    """P-EAGLE files speculators 0.9.0 writes were all refused ("norm_output=false"): speculators writes that key into
    every P-EAGLE config, where it changes nothing (one lm_head(norm(h)) per element, peagle/core.py:186-188).
    Imported, the draft gives speculators' own forward's logits at every anchor and depth."""
    d = ref["peagle"]["peagle_llama"]
    assert detect_draft_format(Path(EXPORTS) / "peagle_llama") == "peagle"
    m = _peagle_model(d)
    assert import_draft(m, Path(EXPORTS) / "peagle_llama") == "peagle"
    got = _peagle_logits(m, ref["input_ids"], d["anchor"], d["depth"])
    assert got.shape == d["logits"].shape and (got - d["logits"]).abs().max() < 1e-4


def test_speculators_peagle_trainer_defaults_are_refused_by_name(ref):
    """norm_before_residual (the speculators trainer's P-EAGLE default) imported as if absent: drafts off by 3.1 in
    the logits. Refused by name now; so are its default Qwen3 layers (q/k norms) and a trained embedding table."""
    with pytest.raises(ExportError, match="P-EAGLE draft was trained with norm_before_residual=true"):
        import_draft(_peagle_model(ref["peagle"]["peagle_nbr"]), Path(EXPORTS) / "peagle_nbr")
    with pytest.raises(ExportError, match="norm_before_residual=true"):
        import_draft(_peagle_model(ref["peagle"]["peagle_default"]), Path(EXPORTS) / "peagle_default")
