"""DFlash: configuration, KV-injection attention (training blocks == one-block drafting), loss, checkpoints,
proposer, export through the engine readers."""
import pytest
import torch

from nemo_spec.config import ConfigError, SpeculativeConfig
from nemo_spec.models import build_gpt
from nemo_spec.speculative import SpeculativeTransform
from nemo_spec.speculative.dflash import DFlashContext, DFlashDraft, sample_anchors
from tests.helpers import tiny_gpt2, tiny_llama
from tests.speculative_utils import perturb_draft, train_draft

torch.set_num_threads(1)


def _model(seed=0, perturb=True, base_cfg=None, **kw):
    torch.manual_seed(seed)
    base = build_gpt(base_cfg or tiny_llama(num_layers=4, init_method_std=0.1))
    args = dict(algorithm="dflash", num_layers=2, block_size=4, target_layer_ids=[0, 2], mask_token_id=7)
    args.update(kw)
    m = SpeculativeTransform(**args)(base)
    return (perturb_draft(m, seed + 1) if perturb else m).eval()


# ---- configuration --------------------------------------------------------------------------------------------
def test_transform_validates_dflash_settings():
    m = _model(perturb=False)
    d = m.eagle_module
    assert isinstance(d, DFlashDraft) and not m.is_eagle and m.aux_layers == [0, 2]
    assert d.fc.weight.shape == (64, 2 * 64) and len(d.layers) == 2 and m.spec_config.num_eagle_layers == 2
    # Qwen3-style layers: per-head q/k RMSNorm; no embedding or LM head of its own
    assert d.layers[0].self_attention.q_layernorm.weight.shape == (16,)
    assert not any("embed" in n or "output_layer" in n for n, _ in d.named_parameters())
    with pytest.raises(ConfigError, match="block_size must be an int >= 2"):
        SpeculativeTransform(algorithm="dflash", block_size=1)
    with pytest.raises(ConfigError, match="only apply to algorithm='dflash'"):
        SpeculativeTransform(algorithm="eagle3", block_size=8)
    with pytest.raises(ConfigError, match="distinct and increasing"):
        SpeculativeTransform(algorithm="dflash", target_layer_ids=[2, 0])
    with pytest.raises(ConfigError, match="target_layer_ids entry 3 outside"):  # the last layer is refused
        SpeculativeTransform(algorithm="dflash", target_layer_ids=[0, 3])(build_gpt(tiny_llama(num_layers=4)))
    with pytest.raises(ConfigError, match="not aux_layers"):
        SpeculativeTransform(algorithm="dflash", aux_layers=[0, 1, 2])
    with pytest.raises(ConfigError, match="disagree"):
        SpeculativeTransform(algorithm="dflash", num_layers=2, num_eagle_layers=3)
    with pytest.raises(ConfigError, match="target_layer_ids is only used by dflash"):
        SpeculativeConfig(algorithm="eagle3", target_layer_ids=[1]).validate()
    with pytest.raises(ConfigError, match=r"dflash_targets must be one of \('base', 'rollout', 'data'\), got 'gold'"):
        SpeculativeTransform(algorithm="dflash", dflash_targets="gold")
    with pytest.raises(ConfigError, match="dflash_targets is only used by dflash, not eagle3"):
        SpeculativeConfig(algorithm="eagle3", dflash_targets="data").validate()
    assert SpeculativeConfig(algorithm="dflash").dflash_targets == "base"
    with pytest.raises(ConfigError, match="mask_token_id=500 outside"):
        SpeculativeTransform(algorithm="dflash", mask_token_id=500, target_layer_ids=[0])(build_gpt(tiny_llama()))
    # defaults: the reference's build_target_layer_ids and the pad / last id as mask, fixed in the stored config
    m8 = SpeculativeTransform(algorithm="dflash", num_layers=3)(build_gpt(tiny_llama(num_layers=8)))
    assert m8.spec_config.target_layer_ids == [1, 3, 5] and m8.spec_config.mask_token_id == 95
    assert SpeculativeTransform(algorithm="dflash")(build_gpt(tiny_llama(num_layers=4))).aux_layers == [2]
    with pytest.raises(ConfigError, match=">= 4 layers"):
        SpeculativeTransform(algorithm="dflash", num_layers=2)(build_gpt(tiny_llama(num_layers=3)))
    # re-applying: same shape is a no-op (block size may change), other target layers are refused
    assert SpeculativeTransform(algorithm="dflash", num_layers=2, block_size=6)(m) is m
    assert m.spec_config.block_size == 6
    assert SpeculativeTransform(algorithm="dflash", num_layers=2, dflash_targets="data")(m) is m  # a training setting
    assert m.spec_config.dflash_targets == "data"
    with pytest.raises(ConfigError, match="target_layer_ids"):
        SpeculativeTransform(algorithm="dflash", num_layers=2, target_layer_ids=[0, 1])(m)
    assert SpeculativeConfig().resolved_loss_decay_gamma() == 7.0


def test_any_base_gpt2_and_qwen3():
    for cfg in (tiny_gpt2(num_layers=3), tiny_llama(num_layers=3, qk_layernorm=True, sliding_window=4)):
        m = SpeculativeTransform(algorithm="dflash", target_layer_ids=[1])(build_gpt(cfg))
        res = m.training_losses(torch.randint(0, 90, (2, 12)))
        assert torch.isfinite(res["loss"]) and len(res["step_losses"]) == 15


def test_hydra_spec_group_composes():
    from nemo_spec.training.cli import compose, typed_config

    tc, _ = typed_config(compose(["model_path=/m", "spec=dflash", "data.path=/d", "spec.block_size=8"]))
    assert tc.spec.algorithm == "dflash" and tc.spec.block_size == 8 and tc.spec.num_eagle_layers == 2


# ---- attention: training blocks == drafting one block over its prefix ----------------------------------------
def _one_block(m, ids, feats, p, B):
    """The draft's block anchored at p drafted alone, context = base features of positions < p."""
    d = m.eagle_module
    tok = torch.full((1, B), d.mask_token_id, dtype=torch.long)
    tok[0, 0] = ids[0, p]
    ctx = DFlashContext(position_ids=torch.arange(p, p + B)[None], target=feats[:, :p].transpose(0, 1),
                        ctx_position_ids=torch.arange(p)[None])
    return d(m.gpt, tok, ctx)[0][0]


def test_training_blocks_equal_one_block_drafting():
    m = _model(seed=1)
    B = m.spec_config.block_size
    ids = torch.randint(0, 90, (1, 20))
    with torch.no_grad():
        out = m.base_forward(ids, compute_logits=False)
        feats = m.fuse(m.base_features(out))
        res = m.training_losses(ids, base_out=out, return_logits=True)
    hid, anchors, keep = res["hidden"], res["anchors"], res["keep"]
    assert keep.all() and anchors.shape[1] == 19  # every p in [0, s - 1) is an anchor (num_anchors 512)
    for n in (0, 1, 7, 18):
        p = int(anchors[0, n])
        torch.testing.assert_close(hid[0, n * B:(n + 1) * B], _one_block(m, ids, feats, p, B), rtol=1e-4, atol=1e-5)


def test_training_chunks_do_not_change_the_result(monkeypatch):
    import nemo_spec.speculative.dflash as dfl

    m = _model(seed=2)
    ids = torch.randint(0, 90, (2, 16))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[1, 9:] = False  # ragged: row 1 has fewer anchors
    with torch.no_grad():
        a = m.training_losses(ids, lm, return_logits=True)["hidden"]
        torch.manual_seed(0)
        monkeypatch.setattr(dfl, "DFLASH_CHUNK_ELEMENTS", 1)  # one block per chunk
        b = m.training_losses(ids, lm, return_logits=True)
    keep = b["keep"].repeat_interleave(4, 1)
    torch.testing.assert_close(a[keep], b["hidden"][keep], rtol=1e-4, atol=1e-5)


def test_anchor_sampling_follows_the_loss_mask():
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    anchors, keep = sample_anchors(lm, 10, torch.Generator().manual_seed(0))
    assert anchors[0][keep[0]].tolist() == [1, 2, 5] and anchors[1][keep[1]].tolist() == [0]
    anchors, keep = sample_anchors(lm, 2, torch.Generator().manual_seed(0))
    assert keep.sum(1).tolist() == [2, 1] and set(anchors[0].tolist()) <= {1, 2, 5}


@pytest.mark.parametrize("targets", ["data", "base", "rollout"])
def test_loss_is_the_decayed_weighted_ce_of_each_block_drafted_alone(targets):
    """The training loss, recomputed by hand: every anchor p (loss_mask[p] and [p+1]; all of them, as num_anchors
    exceeds the length) drafted alone over its prefix; slot k >= 1 scored by CE against its label, weighted
    exp(-(k-1)/gamma) * loss_mask[p+k] (0 past the end), normalised by the summed weights. The label is x_{p+k}
    (``dflash_targets="data"``), the argmax of a plain base forward's logits at p + k - 1 (``"base"``), or the
    k-th token our AR engine generates after x_{<=p} (``"rollout"``)."""
    from nemo_spec.inference import SamplingParams, generate

    import math

    import torch.nn.functional as F

    m = _model(seed=4, block_size=4, loss_decay_gamma=2.0, dflash_targets=targets)
    B, gamma = 4, m.spec_config.resolved_loss_decay_gamma()
    assert gamma == 2.0
    ids = torch.randint(0, 90, (2, 14), generator=torch.Generator().manual_seed(5))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[0, 5] = lm[0, 6] = False  # a hole: no anchors at 4, 5, 6; slots landing on 5, 6 weigh 0
    lm[1, 6:] = False  # a second, shorter row: [b, s] layouts must not be confused with [s, b]
    with torch.no_grad():
        out = m.base_forward(ids, compute_logits=False)
        feats = m.fuse(m.base_features(out))
        got = m.training_losses(ids, lm, base_out=out)["loss"]
        greedy = m.base_forward(ids).logits.argmax(-1)  # [b, s]: the base's next token after x_{<=t}
        labels = ids if targets == "data" else torch.cat([ids[:, :1], greedy[:, :-1]], 1)  # label of position t
        assert targets == "data" or not torch.equal(labels[:, 1:], ids[:, 1:])  # the two label sets differ here
        rollouts = {(r, p): generate(m, [ids[r, :p + 1].tolist()], SamplingParams(max_new_tokens=B - 1))[0].tokens
                    for r in range(2) for p in range(13)} if targets == "rollout" else {}
        if rollouts:  # a rollout is not the teacher-forced labels: somewhere they differ
            assert any(rollouts[(r, p)][k - 1] != int(labels[r, p + k]) for (r, p) in rollouts for k in (2, 3)
                       if p + k < 14)
        num = den = 0.0
        for r, p in [(r, p) for r in range(2) for p in range(13)]:
            if not (lm[r, p] and lm[r, p + 1]):
                continue
            tok = torch.full((1, B), m.eagle_module.mask_token_id, dtype=torch.long)
            tok[0, 0] = ids[r, p]
            ctx = DFlashContext(position_ids=torch.arange(p, p + B)[None], target=feats[r:r + 1, :p].transpose(0, 1),
                                ctx_position_ids=torch.arange(p)[None])
            logits = m.eagle_module(m.gpt, tok, ctx)[1][0].float()
            for k in range(1, B):
                if p + k >= ids.shape[1] or not lm[r, p + k]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                label = rollouts[(r, p)][k - 1] if rollouts else int(labels[r, p + k])
                num += w * float(F.cross_entropy(logits[k][None], torch.tensor([label])))
                den += w
    torch.testing.assert_close(got, torch.tensor(num / den), rtol=1e-4, atol=1e-5)


def test_rollout_labels_are_the_bases_greedy_continuation_of_each_anchor():
    """dflash_targets="rollout": slot k of the block anchored at p is scored against the k-th token greedy decoding
    generates after x_{<=p} (our AR engine, run per anchor), for every anchor of a ragged batch side by side."""
    from nemo_spec.inference import SamplingParams, generate
    from nemo_spec.speculative.dflash import rollout_labels, sample_anchors

    m = _model(seed=8, block_size=5, dflash_targets="rollout")
    ids = torch.randint(0, 90, (2, 13), generator=torch.Generator().manual_seed(3))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[1, 4:] = False  # row 1 has 3 anchors: the other 3 are padding
    anchors, keep = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    assert keep[0].all() and keep[1].sum() == 3
    with torch.no_grad():
        first = m.base_forward(ids).logits.argmax(-1)[torch.arange(2)[:, None], anchors]
        got = rollout_labels(m, ids, anchors, first, 3)  # [2, 6, 4]
        for r in range(2):
            for n in range(6):
                if keep[r, n]:
                    p = int(anchors[r, n])
                    want = generate(m, [ids[r, :p + 1].tolist()], SamplingParams(max_new_tokens=4))[0].tokens
                    assert got[r, n].tolist() == want, (r, p)


@pytest.mark.parametrize("window", [None, 3])
def test_rollout_labels_continue_the_training_forwards_keys_and_values(monkeypatch, window):
    """Online training: the rollouts start from the keys/values the training base forward captured (every layer,
    rotated, compact copies), not from a second base forward over the sequence, and give the same labels and loss
    -- also on a sliding-window base, whose rollout masks read the sequence's positions in the cache."""
    import nemo_spec.models as M
    import nemo_spec.speculative.dflash as D
    from nemo_spec.speculative.losses import base_outputs

    cfg = tiny_llama(num_layers=4, init_method_std=0.1, sliding_window=window)
    m = _model(seed=8, base_cfg=cfg, block_size=5, dflash_targets="rollout")
    ids = torch.randint(0, 90, (2, 13), generator=torch.Generator().manual_seed(3))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[1, 4:] = False
    anchors, keep = D.sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    kv = {}
    with torch.no_grad():
        first = base_outputs(m, ids, capture_kv=kv).logits.argmax(-1)[torch.arange(2)[:, None], anchors]
        assert sorted(kv) == [0, 1, 2, 3] and kv[0][0].shape[2] == 13
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for kv_ in kv.values() for t in kv_)
        want = D.rollout_labels(m, ids, anchors, first, 3)
        fwd, seq_reads = M.gpt_forward, []

        def counted(gpt, input_ids, *a, **k):
            seq_reads.append(input_ids.shape[1] == 13)
            return fwd(gpt, input_ids, *a, **k)

        monkeypatch.setattr(M, "gpt_forward", counted)
        got = D.rollout_labels(m, ids, anchors, first, 3, seq_kv=kv)
    assert torch.equal(got, want) and len(seq_reads) == 3 and not any(seq_reads) and not kv  # consumed
    monkeypatch.setattr(M, "gpt_forward", fwd)

    # training_losses hands the captured keys/values to the rollouts; dropping them changes nothing but the cost
    roll, given = D.rollout_labels, []

    def spy(model, input_ids, anchors, first, steps, seq_kv=None, drop=False):
        given.append(len(seq_kv or {}))
        return roll(model, input_ids, anchors, first, steps, None if drop else seq_kv)

    monkeypatch.setattr(D, "rollout_labels", spy)
    with torch.no_grad():
        loss = m.training_losses(ids, lm, generator=torch.Generator().manual_seed(1))["loss"]
        monkeypatch.setattr(D, "rollout_labels", lambda *a, **k: spy(*a, **k, drop=True))
        again = m.training_losses(ids, lm, generator=torch.Generator().manual_seed(1))["loss"]
    assert given == [4, 4] and torch.equal(loss, again)


def test_rollout_labels_refuse_expert_parallelism_and_overlong_rows(monkeypatch):
    from nemo_spec import parallel
    from nemo_spec.speculative.dflash import rollout_labels

    m = _model(seed=8, dflash_targets="rollout")
    anchors, first = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="sequences of 257 tokens exceed the base's 256 positions"):
        rollout_labels(m, torch.zeros(1, 257, dtype=torch.long), anchors, first, 2)
    monkeypatch.setattr(parallel, "ep_size", lambda: 2)
    with pytest.raises(ValueError, match="not supported with expert parallelism"):
        rollout_labels(m, torch.zeros(1, 8, dtype=torch.long), anchors, first, 2)


def test_training_lowers_the_loss_and_leaves_the_base_alone():
    m = _model(seed=3, perturb=False)
    m.train()
    base_before = {k: v.clone() for k, v in m.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.manual_seed(0)
    data = torch.randint(0, 12, (4, 24))  # a small alphabet: learnable quickly
    losses = [float(r["loss"]) for r in train_draft(m, data, 30)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(torch.equal(v, m.gpt.state_dict()[k]) for k, v in base_before.items())  # base bit-identical
    assert all(p.grad is None for p in m.gpt.parameters())


def test_checkpoint_roundtrip(tmp_path):
    from nemo_spec.checkpoint import load_model, read_checkpoint_config, save_checkpoint

    m = _model(seed=4)
    path = save_checkpoint(m, tmp_path / "df")
    conf = read_checkpoint_config(path)["speculative"]
    assert conf["algorithm"] == "dflash" and conf["target_layer_ids"] == [0, 2] and conf["block_size"] == 4
    loaded = load_model(path)
    assert loaded.spec_config == m.spec_config and isinstance(loaded.eagle_module, DFlashDraft)
    a, b = m.state_dict(), loaded.state_dict()
    assert all(torch.equal(a[k], b[k]) for k, v in a.items() if isinstance(v, torch.Tensor) and "_extra" not in k)
    ids = torch.randint(0, 90, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(m.training_losses(ids)["loss"], loaded.eval().training_losses(ids)["loss"])


# ---- generation: the cached context == the uncached block forward (ragged rows) ---------------------------------
def test_cached_context_block_equals_uncached_block():
    m = _model(seed=5)
    d = m.eagle_module
    B = 4
    ids = torch.randint(0, 90, (2, 14))
    lens = [9, 5]  # row 1 is shorter: ragged context
    with torch.no_grad():
        feats = m.fuse(m.base_features(m.base_forward(ids, compute_logits=False)))
        cache = m.new_draft_cache(2, 32)
        # inject in two pieces per row (prefill chunk, then a "verified path"), right-padded
        d.write_context(cache, feats[:, :3], torch.tensor([3, 3]))
        rest = torch.zeros(2, 6, feats.shape[-1])
        rest[0, :6], rest[1, :2] = feats[0, 3:9], feats[1, 3:5]
        d.write_context(cache, rest, torch.tensor([6, 2]))
        assert cache.lengths.tolist() == lens
        tok = torch.full((2, B), d.mask_token_id, dtype=torch.long)
        tok[:, 0] = torch.tensor([ids[0, 9], ids[1, 5]])
        pos = cache.lengths[:, None] + torch.arange(B)[None]
        got = d(m.gpt, tok, DFlashContext(position_ids=pos, cache=cache, kv_len=9))[0]
        for r, p in enumerate(lens):
            torch.testing.assert_close(got[r], _one_block(m, ids[r:r + 1], feats[r:r + 1], p, B), rtol=1e-4,
                                       atol=1e-5)


def test_drafting_runs_on_the_fast_path_and_equals_the_modules(monkeypatch):
    """Drafting (no gradients) runs the draft layers and the context injection on the fast path, not megatron's
    SelfAttention forward, with the same block logits as the modules' own forward (cached and uncached)."""
    from nemo_spec.models import fastpath
    from nemo_spec.speculative.dflash import DFlashSelfAttention

    m = _model(seed=6)
    d = m.eagle_module
    ids = torch.randint(0, 90, (2, 12))
    calls = []
    orig = DFlashSelfAttention.forward
    monkeypatch.setattr(DFlashSelfAttention, "forward", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))

    def both():
        feats = m.fuse(m.base_features(m.base_forward(ids, compute_logits=False)))
        uncached = d(m.gpt, ids[:, 8:], DFlashContext(position_ids=torch.arange(8, 12)[None].expand(2, 4),
                                                      target=feats[:, :8].transpose(0, 1),
                                                      ctx_position_ids=torch.arange(8)[None].expand(2, 8)))[1]
        cache = m.new_draft_cache(2, 16)
        d.write_context(cache, feats[:, :8], torch.tensor([8, 8]))
        pos = cache.lengths[:, None] + torch.arange(4)[None]
        return uncached, d(m.gpt, ids[:, 8:], DFlashContext(position_ids=pos, cache=cache, kv_len=8))[1]

    with torch.no_grad():
        fast = both()
        assert not calls  # neither forward went through megatron's attention module
        monkeypatch.setattr(fastpath, "ENABLED", False)
        slow = both()
        assert calls
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f, s, rtol=1e-5, atol=1e-5)


# ---- export: the z-lab format through the SGLang 0.5.23 / vLLM 0.33.0 / z-lab readers -----------------------
def test_session_proposals_equal_the_uncached_one_block_draft(monkeypatch):
    """Greedy equality cannot see a wrong draft (the target corrects it), so every block the proposer drafts in a
    real session -- rows joining (max_batch 3 of 8), chunked prefill, slots swapped, greedy and sampled rows -- is
    compared with the draft run without its cache over the row's whole sequence; the draft cache holds exactly the
    committed context."""
    import nemo_spec.inference.proposers.dflash as D
    from nemo_spec.inference import SamplingParams, generate

    m = _model(seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in m.draft_parameters():  # drafts that differ from the target: real rejections and ragged rows
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    d = m.eagle_module

    def uncached_logits(seq, k):  # slots 1..k of the whole trained block anchored at the row's last token, no cache
        L, n = len(seq) - 1, max(k, d.block_size - 1)
        feats = m.fuse(m.base_features(m.base_forward(torch.tensor([seq]), compute_logits=False)))
        tok = torch.full((1, n + 1), d.mask_token_id, dtype=torch.long)
        tok[0, 0] = seq[L]
        ctx = DFlashContext(position_ids=torch.arange(L, L + n + 1)[None], target=feats[:, :L].transpose(0, 1),
                            ctx_position_ids=torch.arange(L)[None])
        return d(m.gpt, tok, ctx)[1][0, 1:k + 1]

    def uncached(seq, k):
        return uncached_logits(seq, k).argmax(-1).tolist()

    orig, seen = D.DFlashProposer.propose, []

    def checked(self, sess, st, level=None):
        tree = orig(self, sess, st, level)
        for r in range(st.b if tree.tokens.shape[1] else 0):
            assert len(st.seqs[r]) - 1 == st.lengths[r] == int(self.cache.lengths[r])
            got = tree.tokens[r].tolist()
            seen.append(got == uncached(st.seqs[r], len(got)))
        return tree

    monkeypatch.setattr(D.DFlashProposer, "propose", checked)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3], [40, 41, 42, 40, 41, 42, 40], [77]] * 2
    budgets = [4 + (3 * i) % 7 for i in range(len(prompts))]
    opts = {"max_batch": 3, "prefill_chunk_tokens": 4}
    with torch.no_grad():
        generate(m, prompts, [SamplingParams(max_new_tokens=n) for n in budgets], method="dflash", options=opts)
        generate(m, prompts, [SamplingParams(max_new_tokens=n, temperature=1.0, seed=i) for i, n in enumerate(budgets)],
                 method="dflash", options=opts)
    assert len(seen) > 20 and all(seen), (len(seen), seen.count(False))
    # fewer draft tokens than trained slots (an option, or a lower adaptive level): the first slots of the SAME
    # block -- the slots attend to each other, so a shorter block would draft other tokens
    seen.clear()
    with torch.no_grad():
        generate(m, prompts, [SamplingParams(max_new_tokens=n) for n in budgets], method="dflash",
                 options={**opts, "num_draft_tokens": 2})
    assert len(seen) > 20 and all(seen), (len(seen), seen.count(False))

    # dflash_tree: node i is the rank-r_i token of slot d_i of the same block, on the static tree
    from nemo_spec.inference.trees import medusa_tree, parallel_tree_choices

    choices = parallel_tree_choices(3)  # the model's block size is 4: three draft slots
    parents, depths, ranks = medusa_tree(choices)

    trees = []

    def checked_tree(self, sess, st, level=None):
        tree = orig(self, sess, st, level)
        assert tree.q is None
        for r in range(st.b if tree.tokens.shape[1] else 0):
            n = tree.tokens.shape[1]
            top = uncached_logits(st.seqs[r], max(depths[:n]) + 1).topk(3).indices
            want = [int(top[dd, k]) for dd, k in zip(depths[:n], ranks[:n])]
            trees.append(tree.tokens[r].tolist() == want and tree.parents[r].tolist() == parents[:n])
        return tree

    monkeypatch.setattr(D.DFlashProposer, "propose", checked_tree)
    with torch.no_grad():
        generate(m, prompts, [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 1.0, seed=i)
                              for i, n in enumerate(budgets)], method="dflash_tree", options=opts)
    assert len(trees) > 20 and all(trees), (len(trees), trees.count(False))


def test_validation_tau_drafts_the_whole_trained_block(monkeypatch):
    """The recipe's tau (trainer.acceptance_depth is a chain length for EAGLE) lets a DFlash draft propose all of
    its B - 1 trained mask slots: tau <= B, not <= acceptance_depth + 1."""
    import nemo_spec.inference.proposers.dflash as D
    from nemo_spec.training.callbacks import measure_tau

    depths = []
    init = D.DFlashProposer.__init__

    def spy(self, model, options):
        init(self, model, options)
        depths.append(self.depth)

    monkeypatch.setattr(D.DFlashProposer, "__init__", spy)
    m = _model(seed=3, block_size=6)
    tau = measure_tau(m, [[5, 6, 7, 8], [11, 3, 4]], depth=2, max_new_tokens=6)
    assert depths == [5] and 1.0 <= tau <= 6.0


def _trained(seed=6, steps=15):
    m = _model(seed=seed)
    train_draft(m, torch.randint(0, 20, (4, 20)), steps)
    return m.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from nemo_spec.export import export_model

    m = _trained()
    d = tmp_path_factory.mktemp("dflash_export") / "exp"
    export_model(m, d, fmt="auto", dtype="fp32", target="all", verify=True)  # verify raises on any mismatch
    return m, d


def test_export_round_trips_through_every_engine_reader(exported):
    import json

    from nemo_spec.export.engines import verify_export

    m, d = exported
    info = json.loads((d / "export_info.json").read_text())
    assert info["format"] == "dflash" and sorted(info["engines"]) == ["reference", "sglang", "trtllm", "vllm"]
    conf = json.loads((d / "draft" / "sglang" / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["block_size"] == 4
    assert conf["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [0, 2]}
    assert "eagle_aux_hidden_state_layer_ids" not in conf and conf["rope_theta"] == 10000.0
    rows = verify_export(d, model=m, seq_len=11)
    assert {r.engine: r.status for r in rows} == {"base": "ok", "vllm": "ok", "sglang": "ok", "reference": "ok",
                                                  "trtllm": "ok"}
    assert all(r.max_abs_diff < 1e-4 for r in rows), rows
    readme = (d / "README.md").read_text()
    assert "DFLASH" in readme and '"method": "dflash"' in readme
    # TensorRT-LLM's block is max_draft_len + 1 slots (speculative/dflash.py DFlashWorker._draft_block_width)
    assert "DFlashDecodingConfig(max_draft_len=3," in readme


def test_readers_catch_broken_exports(exported, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from nemo_spec.export.engines import verify_export

    m, d = exported

    def broken(edit_conf=None, edit_w=None):
        out = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d, out)
        for eng in ("vllm", "sglang", "reference", "trtllm"):
            p = out / "draft" / eng
            conf = json.loads((p / "config.json").read_text())
            if edit_conf:
                edit_conf(conf)
            (p / "config.json").write_text(json.dumps(conf))
            if edit_w:
                w = load_file(p / "model.safetensors")
                edit_w(w)
                save_file(w, p / "model.safetensors")
        return {r.engine: r for r in verify_export(out, model=m, seq_len=11) if r.engine != "base"}

    # the off-by-one: ids naming the residual entering each layer (vLLM's own numbering) shift every reader
    rows = broken(lambda c: c["dflash_config"].update(target_layer_ids=[1, 3]))
    assert all(r.status == "mismatch" for r in rows.values()), rows
    # vLLM takes eagle_aux_hidden_state_layer_ids as is (no +1): written in z-lab numbering it is wrong for vLLM
    rows = broken(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2]))
    assert rows["vllm"].status == "mismatch"
    assert rows["sglang"].status == rows["reference"].status == rows["trtllm"].status == "ok"
    rows = broken(lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=64))  # causal in vLLM
    assert rows["vllm"].status == "mismatch" and rows["trtllm"].status == "mismatch"
    # TensorRT-LLM fills target_layer_ids only from dflash_config (llm_args.py validate_speculative_config): a
    # top-level key (SGLang's fallback) leaves it capturing nothing
    rows = broken(lambda c: c.update(target_layer_ids=c["dflash_config"].pop("target_layer_ids")))
    assert rows["trtllm"].status == "mismatch" and "no target_layer_ids" in rows["trtllm"].detail
    assert rows["sglang"].status == "ok"
    rows = broken(lambda c: c["dflash_config"].update(mask_token_id=8))
    assert all(r.status == "mismatch" for r in rows.values())
    rows = broken(edit_w=lambda w: w.pop("layers.1.self_attn.k_norm.weight"))
    assert all(r.status == "mismatch" and "k_norm" in r.detail for r in rows.values())
    rows = broken(edit_w=lambda w: w.update(mask_hidden=torch.zeros(1, 1, 128)))
    assert rows["vllm"].status == "mismatch" and "mask_hidden" in rows["vllm"].detail


def test_trtllm_block_width_is_max_draft_len_plus_one(exported):
    """TensorRT-LLM computes max_draft_len + 1 block slots (speculative/dflash.py DFlashWorker._draft_block_width) and
    refuses a block wider than the checkpoint's block_size (_lazy_init_ctx_buffers); the block attends both ways,
    so a narrower one changes every slot: the launch must pass max_draft_len = block_size - 1."""
    from nemo_spec.export.engines import EngineMismatch, trtllm
    from nemo_spec.export.engines._llama import base_forward

    m, d = exported
    ids = torch.tensor([[3, 9, 4, 11, 5, 2, 8, 6, 10]])
    run = base_forward(d / "base", ids)
    full = trtllm.draft_logits("dflash", d / "draft" / "trtllm", run, ids, {"max_draft_len": 3})
    assert full.shape[1] == 4
    assert torch.equal(full, trtllm.draft_logits("dflash", d / "draft" / "trtllm", run, ids, {}))
    narrow = trtllm.draft_logits("dflash", d / "draft" / "trtllm", run, ids, {"max_draft_len": 2})
    assert narrow.shape[1] == 3 and (narrow - full[:, :3]).abs().max() > 1e-3
    with pytest.raises(EngineMismatch, match="at most the checkpoint's block_size 4"):
        trtllm.draft_logits("dflash", d / "draft" / "trtllm", run, ids, {"max_draft_len": 4})


@pytest.mark.slow
def test_tp2_import_and_export(exported, tmp_path):
    """A TP=1 DFlash export imports exactly at TP=2 (its q/k norms and fused fc included), and the checkpoint
    exported at TP=2 writes the same files as at TP=1."""
    from nemo_spec.checkpoint import save_checkpoint
    from nemo_spec.export import draft_state_dict, export_checkpoint
    from nemo_spec.export.formats import load_tensors
    from tests.helpers import ROOT, run_torchrun

    m, d = exported
    ckpt = save_checkpoint(m, tmp_path / "ckpt")
    torch.save({"ckpt": str(ckpt), "export": str(d), "draft": draft_state_dict(m), "algorithm": "dflash",
                "target": "sglang"}, tmp_path / "blob.pt")
    assert "DRAFT_EXPORT_TP2_OK dflash" in run_torchrun(ROOT / "tests" / "dist_scripts" / "draft_export_tp2.py",
                                                        [tmp_path], timeout=300)
    exp1 = export_checkpoint(ckpt, tmp_path / "tp1", dtype="fp32", include_base=False, target="sglang")
    files = sorted(p.relative_to(exp1) for p in exp1.rglob("*.safetensors"))
    tp2 = tmp_path / "tp2"
    assert files and files == sorted(p.relative_to(tp2) for p in tp2.rglob("*.safetensors"))
    for f in files:
        a, b = load_tensors(exp1 / f), load_tensors(tp2 / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_import_draft_restores_the_draft(exported):
    from nemo_spec.export import import_draft

    m, d = exported
    fresh = _model(seed=9)
    assert import_draft(fresh, d) == "dflash"
    a, b = m.eagle_module.state_dict(), fresh.eagle_module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k, v in a.items() if isinstance(v, torch.Tensor) and "_extra" not in k)


def test_import_draft_refuses_a_draft_of_other_settings(exported, tmp_path):
    """A DFlash export made for other base layers, another mask token, block size or layer count is refused by
    name (it would load and draft from the wrong inputs); a missing or an extra tensor is an ExportError."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nemo_spec.export import ExportError, import_draft

    m, d = exported
    for kw, needle in ((dict(target_layer_ids=[1, 2]), "target_layer_ids"), (dict(mask_token_id=9), "mask_token_id"),
                       (dict(block_size=3), "block_size"), (dict(num_layers=1), "num_hidden_layers")):
        with pytest.raises(ExportError, match=needle):
            import_draft(_model(seed=9, **kw), d)

    def edited(edit):
        out = tmp_path / f"e{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d, out)
        for p in (out / "draft").glob("*/model.safetensors"):
            w = load_file(p)
            edit(w)
            save_file(w, p)
        return out

    with pytest.raises(ExportError, match="hidden_norm.weight"):
        import_draft(_model(seed=9), edited(lambda w: w.pop("hidden_norm.weight")))
    with pytest.raises(ExportError, match="unexpected"):
        import_draft(_model(seed=9), edited(lambda w: w.update(mask_hidden=torch.zeros(1, 1, 8))))
    with pytest.raises(ExportError, match="unexpected"):  # a third layer the draft does not have
        import_draft(_model(seed=9), edited(lambda w: w.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in
                                                                 list(w.items()) if k.startswith("layers.1.")})))


@pytest.mark.parametrize("change,words", [
    ({"dflash_config": {"causal": True}}, "causal attention"),
    ({"is_causal": True}, "causal attention"),
    ({"layer_types": ["sliding_attention", "sliding_attention"]}, "causal attention .* and sliding-window attention"),
    ({"dflash_config": {"use_swa": True}}, "sliding-window attention")])
def test_import_draft_refuses_causal_or_sliding_window_drafts(exported, tmp_path, change, words):
    """DFlash drafts whose layers run causally or over a window (vLLM reads is_causal, dflash_config.causal /
    use_swa and layer_types: qwen3_dflash.py:86-115 @ 0.34.0; speculators' trainer writes sliding causal layers by
    default) imported as nemo_spec's bidirectional full-context draft: another function (logits off by 4.2)."""
    import json
    import shutil

    from nemo_spec.export import ExportError, import_draft

    _, d = exported
    out = tmp_path / "e"
    shutil.copytree(d, out)
    for p in (out / "draft").glob("*/config.json"):
        conf = json.loads(p.read_text())
        for k, v in change.items():
            conf[k] = {**conf[k], **v} if isinstance(v, dict) and isinstance(conf.get(k), dict) else v
        p.write_text(json.dumps(conf))
    with pytest.raises(ExportError, match=words):
        import_draft(_model(seed=9), out)


def test_offline_base_states_give_the_online_loss():
    from nemo_spec.training.offline import base_output_from_batch

    m = _model(seed=7)
    ids = torch.randint(0, 90, (2, 16))
    with torch.no_grad():
        out = m.base_forward(ids, compute_logits=False)
        batch = {"input_ids": ids, "base_hidden": out.hidden, "base_aux": torch.stack(out.aux_hidden, 2)}
        stored = base_output_from_batch(m, batch)
        assert stored.logits is None  # the base's labels come from the stored final hidden states, a row block
        # at a time (dflash_targets="base", the default); the online forward computes them the same way
        torch.manual_seed(0)
        online = m.training_losses(ids)["loss"]
        torch.manual_seed(0)
        offline = m.training_losses(ids, base_out=stored)["loss"]
    torch.testing.assert_close(online, offline)
