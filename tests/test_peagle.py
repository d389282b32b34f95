"""P-EAGLE: configuration, COD sampling and its mask, training == one-forward drafting, loss falls, checkpoints."""
import pytest
import torch

from nemo_spec.config import ConfigError, SpeculativeConfig
from nemo_spec.models import AttnContext, build_gpt
from nemo_spec.speculative import SpeculativeTransform
from nemo_spec.speculative.peagle import (PEagleDraft, cod_element_counts, flatten_cod,
                                          peagle_attention_mask)
from tests.helpers import tiny_llama
from tests.inference_utils import SLOT_REUSE_ROWS, recorded_proposals, train_on_own_continuations
from tests.speculative_utils import perturb_draft, train_draft

torch.set_num_threads(1)


def _model(seed=0, perturb=True, **kw):
    torch.manual_seed(seed)
    base = build_gpt(tiny_llama(num_layers=4, init_method_std=0.1))
    args = dict(algorithm="peagle", num_eagle_layers=2, parallel_depth=3, mask_token_id=7)
    args.update(kw)
    m = SpeculativeTransform(**args)(base)
    return (perturb_draft(m, seed + 1) if perturb else m).eval()


# ---- configuration --------------------------------------------------------------------------------------------
def test_transform_validates_peagle_settings():
    m = _model(perturb=False)
    assert isinstance(m.eagle_module, PEagleDraft) and m.is_eagle and m.aux_layers == [1, 1, 0]
    assert m.spec_config.mask_token_id == 7 and m.eagle_module.mask_hidden.shape == (1, 1, 3 * 64)
    assert torch.equal(m.eagle_module.mask_embed, m.gpt.embedding.word_embeddings.weight[7])
    with pytest.raises(ConfigError, match="parallel_depth must be > 0"):
        SpeculativeTransform(algorithm="peagle", parallel_depth=0)
    with pytest.raises(ConfigError, match="only apply to algorithm='peagle'"):
        SpeculativeTransform(algorithm="eagle3", mask_token_id=3)
    with pytest.raises(ConfigError, match="cod_ratio must be in"):
        SpeculativeTransform(algorithm="peagle", cod_ratio=1.5)
    with pytest.raises(ConfigError, match="mask_token_id=500 outside the base vocabulary"):
        SpeculativeTransform(algorithm="peagle", mask_token_id=500)(build_gpt(tiny_llama()))
    with pytest.raises(ConfigError, match="mask_token_id is only used by peagle"):
        SpeculativeConfig(algorithm="eagle3", mask_token_id=1).validate()
    # default mask id: the pad id, else the last vocabulary id; fixed in the draft's config
    assert SpeculativeTransform(algorithm="peagle")(build_gpt(tiny_llama())).spec_config.mask_token_id == 95
    assert SpeculativeTransform(algorithm="peagle")(build_gpt(tiny_llama(pad_token_id=3))).spec_config.mask_token_id == 3
    # re-applying: same shape is a no-op (depth may change), another mask id is refused
    assert SpeculativeTransform(algorithm="peagle", num_eagle_layers=2, parallel_depth=5)(m) is m
    assert m.spec_config.parallel_depth == 5 and m.spec_config.mask_token_id == 7
    with pytest.raises(ConfigError, match="mask_token_id"):
        SpeculativeTransform(algorithm="peagle", num_eagle_layers=2, mask_token_id=8)(m)


def test_hydra_spec_group_composes():
    from nemo_spec.training.cli import compose, typed_config

    tc, _ = typed_config(compose(["model_path=/m", "spec=peagle", "data.path=/d", "spec.parallel_depth=3"]))
    assert tc.spec.algorithm == "peagle" and tc.spec.parallel_depth == 3 and tc.spec.num_eagle_layers == 2


# ---- COD sampling and the mask ----------------------------------------------------------------------------------
def test_cod_sampling_keeps_nested_chains_with_targets():
    s, D, r, rmin = 60, 4, 0.7, 0.2
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(1, s, generator=g) > 0.2
    anchor, depth, present = flatten_cod(loss_mask, D, r, rmin, generator=g)
    a, d = anchor[0][present[0]], depth[0][present[0]]
    assert torch.equal(a[d == 0], torch.arange(s))  # depth 0: every position
    n0 = int(loss_mask[0, 2:].sum())
    want = cod_element_counts(n0, D, r, rmin)
    def valid(t, k):
        return t + 2 + k < s and bool(loss_mask[0, t + 2 + k])

    alive = [t for t in range(s) if valid(t, 0)]
    for k in range(1, D):
        ak = a[d == k].tolist()
        assert ak == sorted(ak) and set(ak) <= set(alive)  # nested: a chain continues only where it was kept
        assert all(valid(t, k) for t in ak)  # every element has a target
        pool = [t for t in alive if valid(t, k)]
        assert len(ak) == min(want[k], len(pool)), (k, len(ak), want[k], len(pool))
        alive = ak
    assert 0 < (d == D - 1).sum() < (d == 1).sum() < (d == 0).sum()


def test_attention_mask_is_the_reference_rule():
    anchor = torch.tensor([[0, 1, 2, 3, 4, 0, 2, 3, 0, 3, 0]])
    depth = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 0]])
    present = torch.tensor([[True] * 10 + [False]])
    m = peagle_attention_mask(anchor, depth, present)[0]
    n = anchor.shape[1]
    for q in range(n):
        for k in range(n):
            aq, ak, dq, dk = anchor[0, q], anchor[0, k], depth[0, q], depth[0, k]
            want = bool(present[0, q] and present[0, k] and ((dk == 0 and ak <= aq) or (ak == aq and dk <= dq)))
            assert bool(m[q, k]) == (want or q == k), (q, k)


# ---- training-time elements are the drafting forward's outputs --------------------------------------------------
def _drafting_logits(m, ids, t, d, skip=0):
    """Logits of one plain causal draft forward over pairs skip..t and d mask slots (what drafting runs; the base
    still reads the whole sequence, the draft's positions count from pair ``skip``)."""
    with torch.no_grad():
        out = m.base_forward(ids[:, : t + 1])
        feats = m.fuse(m.base_features(out))[:, skip:]
        mf = m.eagle_module.mask_feature()
        tok = torch.cat([ids[:, 1 + skip: t + 2], torch.full((1, d), m.eagle_module.mask_token_id)], 1)
        feat = torch.cat([feats, mf[None, None].expand(1, d, -1)], 1)
        ctx = AttnContext(position_ids=torch.arange(t + 1 - skip + d)[None])
        return m.draft_step(tok, feat, ctx)[1][0, -1]


def test_flattened_training_elements_equal_one_forward_drafting():
    m = _model()
    torch.manual_seed(4)
    ids = torch.randint(0, 96, (1, 24))
    torch.manual_seed(9)
    res = m.training_losses(ids, return_logits=True)
    logits, anchor, depth, present = res["step_logits"][0][0], res["anchor"][0], res["depth"][0], res["present"][0]
    checked = 0
    for i in range(0, int(present.sum()), 7):
        t, d = int(anchor[i]), int(depth[i])
        if t + 1 >= ids.shape[1]:
            continue
        torch.testing.assert_close(logits[i], _drafting_logits(m, ids, t, d), atol=2e-5, rtol=1e-5)
        checked += int(d > 0)
    assert checked >= 3


def test_proposer_drafts_what_the_one_forward_predicts():
    """Every step's chain (ragged batch) is the argmax of the plain forward [pairs..., bonus pair, mask x (K-1)];
    also for a row that takes over the slot of a finished one. The draft is trained on the target's continuations,
    so steps accept drafts and rows carry several pending pairs; after every forward the proposer's per-slot block
    buffers hold only mask slots again."""
    from tests.inference_utils import accepted_drafts

    m = train_on_own_continuations(_model(seed=2), [p for p, _ in SLOT_REUSE_ROWS], 60)
    K = 3
    admitted = []  # (the slot held a previous row's pairs, it holds only mask slots after admission)

    def all_mask(prop, rows):
        return bool((prop.blk_tok[rows] == prop.mask_token_id).all() and (prop.blk_feat[rows] == prop.mask_feat).all())

    def blocks_reset(prop, st):
        assert all_mask(prop, slice(0, st.b)) and max(prop.pend_n[:st.b]) == 0  # the forward consumed them
        if "admit" not in vars(prop):  # from the first step on, check every admission too
            orig = prop.admit

            def admit(sess, slot, row):
                stale = not all_mask(prop, slot)
                orig(sess, slot, row)
                admitted.append((stale, all_mask(prop, slot)))
            prop.admit = admit

    seen, results = recorded_proposals(m, "peagle", SLOT_REUSE_ROWS, {"num_draft_tokens": K}, after=blocks_reset)
    assert len(seen) >= 3 and admitted and all(ok for _, ok in admitted)
    assert any(stale for stale, _ in admitted)  # a finished row had left pending pairs in the reused slot
    assert sum(accepted_drafts(r) for r in results) >= 3, [r.stats["accept_hist"] for r in results]
    assert any(seq[:3] == [7, 1, 30] for seqs, _, _ in seen for seq in seqs)
    ids_of = m.draft_vocab_ids()
    for seqs, _, tokens in seen:
        for r, seq in enumerate(seqs):
            ids = torch.tensor([seq])
            want = [int(ids_of[_drafting_logits(m, ids, len(seq) - 2, d).argmax()]) for d in range(K)]
            assert tokens[r].tolist() == want, (seq, tokens[r].tolist(), want)


@pytest.mark.parametrize("extra", [{}, {"prefill_chunk_tokens": 2}, {"prefill_chunk_tokens": 3, "max_batch": 3}],
                         ids=["one-chunk", "chunked", "chunked-3-slots"])
def test_draft_prompt_window_reads_only_the_last_prompt_pairs(extra):
    """draft_prompt_tokens=W: every step's chain is the argmax of the plain forward over the prompt's last W pairs
    (plus every generated one), positions counted from the window — with the prompt read in one chunk or in chunks
    that fall wholly before the window or straddle it, and a row taking over a finished row's slot; greedy output
    == AR; a window covering every prompt gives the proposals of no window; by default the window is the draft's
    recorded training length."""
    from nemo_spec.inference import generate
    from nemo_spec.inference.sampling import SamplingParams

    m = train_on_own_continuations(_model(seed=2), [p for p, _ in SLOT_REUSE_ROWS], 60)
    K, W = 3, 2
    prompts = [p for p, _ in SLOT_REUSE_ROWS]
    opts = {"num_draft_tokens": K, "draft_prompt_tokens": W, **extra}
    mb = opts.pop("max_batch", 2)
    seen, results = recorded_proposals(m, "peagle", SLOT_REUSE_ROWS, opts, max_batch=mb)
    ids_of = m.draft_vocab_ids()
    checked = 0
    for seqs, _, tokens in seen:
        for r, seq in enumerate(seqs):
            prompt = next(p for p in prompts if seq[:len(p)] == p)
            skip = max(0, len(prompt) - W)
            ids = torch.tensor([seq])
            want = [int(ids_of[_drafting_logits(m, ids, len(seq) - 2, d, skip).argmax()]) for d in range(K)]
            assert tokens[r].tolist() == want, (seq, tokens[r].tolist(), want)
            checked += int(skip > 0)
    assert checked >= 3
    ar = generate(m, prompts, SamplingParams(max_new_tokens=8), method="ar")
    for res, ref, (_, n) in zip(results, ar, SLOT_REUSE_ROWS):
        assert res.tokens == ref.tokens[:n]

    def chains(o):
        return [t.tolist() for _, _, t in recorded_proposals(m, "peagle", SLOT_REUSE_ROWS, o, max_batch=mb)[0]]

    whole = chains({**opts, "draft_prompt_tokens": 0})
    assert chains({**opts, "draft_prompt_tokens": 6}) == whole != [t.tolist() for _, _, t in seen]
    m.trained_seq_len = W
    assert chains({k: v for k, v in opts.items() if k != "draft_prompt_tokens"}) == [t.tolist() for _, _, t in seen]


def test_tree_proposer_places_the_one_forwards_top_k_on_the_static_tree():
    """peagle_tree: node i of every step's tree is the rank-r_i token of depth d_i's distribution of the same single
    forward the chain uses, under the static tree's parents (ragged batch, greedy and sampled rows)."""
    from nemo_spec.inference import SamplingParams
    from nemo_spec.inference.session import Session
    from nemo_spec.inference.trees import medusa_tree, parallel_tree_choices

    m = _model(seed=2)
    K = 3
    choices = parallel_tree_choices(K)
    parents, depths, ranks = medusa_tree(choices)
    prop = Session(m, "peagle_tree", options={"num_draft_tokens": K}, max_batch=2).proposer
    assert prop.levels == [0, 3, 6, 8] and prop.lookahead == len(choices) == 8
    seen, _ = recorded_proposals(m, "peagle_tree", [([5, 9, 11, 3, 5, 9], 8),
                                                    ([40, 2], SamplingParams(max_new_tokens=6, temperature=1.0,
                                                                             seed=3))], {"num_draft_tokens": K})
    assert len(seen) >= 4
    ids_of = m.draft_vocab_ids()
    for seqs, tree, _ in seen:
        assert tree.q is None  # deterministic candidates at any temperature
        for r, seq in enumerate(seqs):
            ids = torch.tensor([seq])
            top = [_drafting_logits(m, ids, len(seq) - 2, d).topk(3).indices for d in range(K)]
            want = [int(ids_of[top[d][k]]) for d, k in zip(depths, ranks)]
            assert tree.tokens[r].tolist() == want, (seq, tree.tokens[r].tolist(), want)
            assert tree.parents[r].tolist() == parents


def test_tree_choices_option():
    """tree_choices picks the static tree (any rank paths within the draft's depths); a bad one is refused by name."""
    from nemo_spec.inference import SamplingParams, generate
    from nemo_spec.inference.sampling import SamplingError

    m = _model(seed=2)
    prompt, sp = [5, 9, 11, 3, 5, 9], SamplingParams(max_new_tokens=6)
    ref = generate(m, [prompt], sp, method="ar")[0].tokens
    out = generate(m, [prompt], sp, method="peagle_tree", options={"tree_choices": [[0], [1], [0, 0], [0, 1]]})[0]
    assert out.tokens == ref and out.stats["method"] == "peagle_tree"
    for bad, why in (([[0], [0, 0, 0, 0]], "deeper than the 3 draft positions"), ([[0, 1]], "lacks its prefix"),
                     ([], "must not be empty"), ("x", "tree_choices")):
        with pytest.raises(SamplingError, match=why):
            generate(m, [prompt], sp, method="peagle_tree", options={"tree_choices": bad})


# ---- the objective ---------------------------------------------------------------------------------------------------
def test_loss_is_kl_and_falls_with_training():
    m = _model(perturb=False)
    torch.manual_seed(1)
    data = torch.randint(0, 96, (4, 32))
    outs = train_draft(m, data, 30, step_seed=100)
    losses = [float(r["loss"]) for r in outs]
    assert all(v >= -1e-5 for v in losses)  # a KL divergence
    res = outs[-1]
    assert len(res["step_losses"]) == 3 and len(res["step_acc"]) == 3
    assert m.eagle_module.mask_hidden.grad is not None and m.eagle_module.mask_embed.grad is not None
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_checkpoint_roundtrip(tmp_path):
    from nemo_spec.checkpoint import load_model, read_checkpoint_config, save_checkpoint

    m = _model(seed=3, draft_vocab_size=48)
    m.set_draft_vocab(torch.arange(96, 0, -1).float(), reinit_head=False)
    path = save_checkpoint(m, tmp_path / "pe")
    conf = read_checkpoint_config(path)["speculative"]
    assert conf["algorithm"] == "peagle" and conf["mask_token_id"] == 7 and conf["parallel_depth"] == 3
    loaded = load_model(path)
    assert loaded.spec_config == m.spec_config
    a, b = m.state_dict(), loaded.state_dict()
    for k in ("eagle_module.mask_hidden", "eagle_module.mask_embed", "eagle_module.d2t", "eagle_module.fc.weight"):
        assert torch.equal(a[k], b[k]), k
    assert all(torch.equal(a[k], b[k]) for k, v in a.items() if isinstance(v, torch.Tensor) and "_extra" not in k)


# ---- export: the speculators format through vLLM 0.33.0's reading ---------------------------------------------
def _trained(seed=4, steps=10):
    """A tiny P-EAGLE draft (reduced vocabulary, unsorted distinct aux layers) trained a few steps."""
    m = _model(seed=seed, draft_vocab_size=48, aux_layers=[3, 0, 1])
    m.set_draft_vocab(torch.arange(96, 0, -1).float(), reinit_head=False)
    data = torch.randint(0, 96, (4, 24), generator=torch.Generator().manual_seed(seed))
    train_draft(m, data, steps, step_seed=100)
    return m.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from nemo_spec.export import export_model

    m = _trained()
    d = tmp_path_factory.mktemp("pe_export")
    export_model(m, d / "exp", dtype="fp32", target="vllm", verify=True)  # the normal path; raises on a mismatch
    return m, d / "exp"


def test_speculators_export_round_trips_through_the_vllm_reader(exported):
    import json

    from nemo_spec.export.engines import base_forward
    from nemo_spec.export.engines.vllm_peagle import our_peagle_logits, peagle_logits

    m, root = exported
    conf = json.loads((root / "draft" / "config.json").read_text())
    assert conf["speculators_model_type"] == "peagle" and conf["mask_token_id"] == 7
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 2
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM ids of base layers 0, 1, 3 (sorted)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    run = base_forward(root / "base", ids)
    theirs, ours = peagle_logits(root / "draft", run, ids, 3), our_peagle_logits(m, ids, 3)
    assert theirs.shape == ours.shape == (2, 8 + 2, 96)
    fin = torch.isfinite(ours)
    assert torch.equal(torch.isfinite(theirs), fin) and int(fin[0, 0].sum()) == 48
    assert (theirs[fin] - ours[fin]).abs().max() < 1e-4


def test_vllm_reader_catches_broken_exports(exported, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from nemo_spec.export.engines import EngineMismatch, base_forward
    from nemo_spec.export.engines.vllm_peagle import our_peagle_logits, peagle_logits

    m, root = exported
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    run = base_forward(root / "base", ids)
    ours = our_peagle_logits(m, ids, 3)

    def variant(edit_conf=None, edit_w=None):
        d = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root / "draft", d)
        if edit_conf:
            c = json.loads((d / "config.json").read_text())
            edit_conf(c)
            (d / "config.json").write_text(json.dumps(c))
        if edit_w:
            w = load_file(str(d / "model.safetensors"))
            edit_w(w)
            save_file(w, str(d / "model.safetensors"))
        return d

    with pytest.raises(EngineMismatch, match="mask_hidden not in the weights"):
        peagle_logits(variant(edit_w=lambda w: w.pop("mask_hidden")), run, ids, 3)
    with pytest.raises(EngineMismatch, match="no mask_token_id"):
        peagle_logits(variant(edit_conf=lambda c: c.pop("mask_token_id")), run, ids, 3)
    # a wrong mask id, unreordered mask_hidden blocks, or a normed residual load but compute different logits
    for conf_edit, w_edit in ((lambda c: c.update(mask_token_id=8), None),
                              (None, lambda w: w.update(mask_hidden=w["mask_hidden"].flip(-1).contiguous())),
                              (lambda c: c.update(norm_before_residual=True), None)):
        theirs = peagle_logits(variant(conf_edit, w_edit), run, ids, 3)
        fin = torch.isfinite(ours)
        assert (theirs[fin] - ours[fin]).abs().max() > 1e-3
    # the depth-0 rows do not depend on the mask inputs: only the mask slots move
    theirs = peagle_logits(variant(edit_w=lambda w: w.update(mask_hidden=torch.zeros_like(w["mask_hidden"]))),
                           run, ids, 3)
    fin = torch.isfinite(ours)
    assert (theirs[:, :6][fin[:, :6]] - ours[:, :6][fin[:, :6]]).abs().max() < 1e-4
    assert (theirs[:, 6:][fin[:, 6:]] - ours[:, 6:][fin[:, 6:]]).abs().max() > 1e-3


def test_export_refuses_duplicate_aux_layers():
    from nemo_spec.export.formats import ExportError
    from nemo_spec.export.peagle import export_peagle

    with pytest.raises(ExportError, match="distinct base layers"):
        export_peagle(_model(perturb=False), "/nonexistent/never-written")


# ---- export through export_model / scripts/export.py / verify_export / import_draft -----------------------------
@pytest.fixture(scope="module")
def exported_all(tmp_path_factory):
    from nemo_spec.checkpoint import save_checkpoint
    from nemo_spec.export import export_model

    m = _trained(seed=5)
    d = tmp_path_factory.mktemp("pe_all")
    ckpt = save_checkpoint(m, d / "ckpt")
    export_model(m, d / "exp", fmt="auto", dtype="fp32", verify=True)
    return m, d / "exp", ckpt


def test_export_model_writes_the_speculators_layout_for_vllm_only(exported_all):
    import json

    from nemo_spec.export import detect_draft_format
    from nemo_spec.export.engines import verify_export

    m, d, _ = exported_all
    info = json.loads((d / "export_info.json").read_text())
    assert info["format"] == "peagle" and list(info["engines"]) == ["vllm"]
    assert info["engines"]["vllm"] == {"dir": "draft/vllm", "launch": {"num_speculative_tokens": 3}}
    assert sorted(info["skipped_engines"]) == ["reference", "sglang", "trtllm"]
    assert "spec_info.py:32-47" in info["skipped_engines"]["sglang"]
    conf = json.loads((d / "draft" / "vllm" / "config.json").read_text())
    assert conf["speculators_model_type"] == "peagle" and conf["architectures"] == ["PEagleSpeculator"]
    assert conf["speculators_config"]["verifier"]["name_or_path"] == str(d / "base")
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4] and conf["torch_dtype"] == "float32"
    assert detect_draft_format(d) == "peagle"
    rows = {r.engine: r for r in verify_export(d, model=m, seq_len=11)}
    assert {k: r.status for k, r in rows.items()} == {"base": "ok", "vllm": "ok", "sglang": "unsupported",
                                                      "trtllm": "unsupported", "reference": "unsupported"}
    assert rows["vllm"].max_abs_diff < 1e-4 and "parallel drafting" in rows["sglang"].detail
    readme = (d / "README.md").read_text()
    assert '"parallel_drafting": true' in readme and "SGLang: not exported" in readme
    # vLLM 0.34.0 removed P-EAGLE (transformers_utils/configs/speculators/algos.py:53-55 raises): the snippet pins 0.33
    assert "pip install 'vllm==0.33.*'" in readme and "0.34.0 removed P-EAGLE" in readme


def test_export_to_an_engine_without_p_eagle_says_so(exported_all, tmp_path):
    from nemo_spec.export import export_model
    from nemo_spec.export.formats import ExportError

    m = exported_all[0]
    for target, why in (("sglang", "no P-EAGLE / parallel drafting"), ("trtllm", "no P-EAGLE / parallel drafting"),
                        ("reference", "no reference reader for P-EAGLE")):
        with pytest.raises(ExportError, match=f"{target} .*cannot serve a peagle draft.*{why}.*serve it: \\['vllm'\\]"):
            export_model(m, tmp_path / target, target=target)
    with pytest.raises(ExportError, match="carries a peagle draft; it cannot be exported as eagle3"):
        export_model(m, tmp_path / "e3", fmt="eagle3")
    assert not any(tmp_path.iterdir())


def test_verify_export_catches_broken_p_eagle_exports(exported_all, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from nemo_spec.export.engines import verify_export

    m, d, _ = exported_all

    def vllm_row(edit_conf=None, edit_w=None):
        out = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d, out)
        p = out / "draft" / "vllm"
        if edit_conf:
            conf = json.loads((p / "config.json").read_text())
            edit_conf(conf)
            (p / "config.json").write_text(json.dumps(conf))
        if edit_w:
            w = load_file(p / "model.safetensors")
            edit_w(w)
            save_file(w, p / "model.safetensors")
        return {r.engine: r for r in verify_export(out, model=m, seq_len=11)}["vllm"]

    r = vllm_row(lambda c: c.update(mask_token_id=8))  # loads, but the mask slots embed another token
    assert r.status == "mismatch" and r.max_abs_diff > 1e-3
    r = vllm_row(edit_w=lambda w: w.pop("layers.1.mlp.down_proj.weight"))
    assert r.status == "mismatch" and "layers.1.mlp.down_proj.weight" in r.detail
    r = vllm_row(edit_w=lambda w: w.pop("mask_hidden"))
    assert r.status == "mismatch" and "mask_hidden" in r.detail
    r = vllm_row(edit_w=lambda w: w.update(d2t=w["d2t"] + 1))  # another draft vocabulary (ids 1..48)
    assert r.status == "mismatch"
    r = vllm_row(lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"))
    assert r.status == "mismatch" and "speculators_config" in r.detail


def test_import_draft_round_trip(exported_all):
    from nemo_spec.checkpoint import load_model
    from nemo_spec.export import import_draft
    from nemo_spec.export.formats import ExportError

    m, d, ckpt = exported_all
    fresh = load_model(ckpt).eval()
    with torch.no_grad():
        for p in fresh.draft_parameters():
            p.mul_(-1.5)
    assert import_draft(fresh, d) == "peagle"
    a, b = m.eagle_module.state_dict(), fresh.eagle_module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k, v in a.items() if isinstance(v, torch.Tensor) and "_extra" not in k)
    with pytest.raises(ExportError, match="mask_token_id=7 but the model's draft uses 9"):
        import_draft(_model(seed=4, draft_vocab_size=48, aux_layers=[3, 0, 1], mask_token_id=9), d)
    with pytest.raises(ExportError, match="captures vLLM layers \\[1, 2, 4\\]"):
        import_draft(_model(seed=4, draft_vocab_size=48, aux_layers=[0, 1, 2]), d)
    with pytest.raises(ExportError, match="differs from the base's table outside the mask row"):
        import_draft(_model(seed=11, draft_vocab_size=48, aux_layers=[3, 0, 1]), d)  # another base


def test_export_and_verify_scripts_on_a_p_eagle_checkpoint(exported_all, tmp_path, capsys):
    import subprocess
    import sys

    from nemo_spec.export import detect_draft_format, import_draft
    from nemo_spec.export.cli import main, verify_main
    from tests.helpers import ROOT

    m, _, ckpt = exported_all
    out = tmp_path / "cli"
    args = ["--checkpoint", str(ckpt), "--export_dir", str(out)]  # format auto, target all, bf16, verified
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), *args], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "vllm       ok" in p.stderr and "sglang     unsupported" in p.stderr
    assert detect_draft_format(out) == "peagle"
    assert verify_main([str(out), "--checkpoint", str(ckpt)]) == 0
    assert "vllm       ok" in capsys.readouterr().out
    from nemo_spec.checkpoint import load_model

    fresh = load_model(ckpt).eval()
    assert import_draft(fresh, out) == "peagle"  # bf16 files: equal to the draft rounded to bf16
    w = fresh.eagle_module.fc.weight
    assert torch.equal(w, m.eagle_module.fc.weight.to(torch.bfloat16).float())
    assert main(args[:-1] + [str(tmp_path / "sg"), "--target", "sglang"]) == 2
    assert "no P-EAGLE / parallel drafting" in capsys.readouterr().err


def test_tp2_import_and_export(exported_all, tmp_path):
    """A TP=1 P-EAGLE export imports exactly at TP=2, and the checkpoint exported at TP=2 writes the same files."""
    from nemo_spec.export import draft_state_dict, export_checkpoint
    from nemo_spec.export.formats import load_tensors
    from tests.helpers import ROOT, run_torchrun

    m, d, ckpt = exported_all
    torch.save({"ckpt": str(ckpt), "export": str(d), "draft": draft_state_dict(m), "algorithm": "peagle",
                "target": "vllm"}, tmp_path / "blob.pt")
    assert "DRAFT_EXPORT_TP2_OK peagle" in run_torchrun(ROOT / "tests" / "dist_scripts" / "draft_export_tp2.py",
                                                        [tmp_path], timeout=300)
    exp1 = export_checkpoint(ckpt, tmp_path / "tp1", dtype="fp32", include_base=False, target="vllm")
    a, b = load_tensors(exp1 / "draft" / "model.safetensors"), load_tensors(tmp_path / "tp2" / "draft" /
                                                                           "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_depth_warmup_trains_depth_0_only_for_the_first_steps():
    """``depth_warmup_steps`` = N: a draft in training mode at optimizer step < N (``train_step``, set by the
    training loop) trains depth 0 only; from step N, in evaluation, or without a step: all depths."""
    with pytest.raises(ConfigError, match="depth_warmup_steps must be an int >= 0"):
        SpeculativeTransform(algorithm="peagle", depth_warmup_steps=-1)
    with pytest.raises(ConfigError, match="only apply to algorithm='peagle'"):
        SpeculativeTransform(algorithm="eagle3", depth_warmup_steps=3)
    with pytest.raises(ConfigError, match="depth_warmup_steps is only used by peagle"):
        SpeculativeConfig(algorithm="dflash", depth_warmup_steps=2).validate()
    m = _model(depth_warmup_steps=2)
    torch.manual_seed(4)
    ids = torch.randint(0, 96, (2, 20))

    def depths(step, train=True):
        m.train(train)
        m.train_step = step
        res = m.training_losses(ids, generator=torch.Generator().manual_seed(0))
        return len(res["step_acc"]), res["num_elements"]

    n0 = 2 * 20  # depth 0 keeps every anchor of both rows
    assert depths(0) == (1, n0) and depths(1) == (1, n0)
    full = depths(2)
    assert full[0] == 3 and full[1] > n0 and depths(7) == full
    assert depths(0, train=False) == full and depths(None) == full
