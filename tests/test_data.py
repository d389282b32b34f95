"""Data: readers for each format, bad-data messages, chat templates + loss masks, split, DP sampler, writer."""
import json

import pytest
import torch

from nemo_spec.data import (ChatTemplateError, DataConfig, DataFormatError, DataParallelBatchSampler,
                            EmptyDatasetError, ReadStats, SpecDataModule, apply_chat_template, encode_chat,
                            load_tokenizer, read_conversations, render_chat, split_indices, write_daring_anteater)
from tests.train_utils import FIXTURES, synthetic_chats, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_daring_anteater_skips_malformed_and_reports_first_error(caplog):
    stats = ReadStats()
    with caplog.at_level("WARNING"):
        recs = read_conversations(FIXTURES / "da.jsonl", "daring_anteater", stats=stats)
    assert [r["id"] for r in recs] == ["da-0", "da-1", "da-4"]
    assert stats.skipped == 2 and stats.kept == 3
    assert stats.first_error.startswith(f"{FIXTURES / 'da.jsonl'}:3: invalid JSON")
    assert "skipped 2 malformed record(s)" in caplog.text and "da.jsonl:3" in caplog.text
    assert recs[0]["system"] == "You are a helpful assistant." and recs[1]["system"] is None
    assert [t["role"] for t in recs[1]["turns"]] == ["user", "assistant", "user", "assistant"]


def test_strict_fails_with_file_and_line():
    with pytest.raises(DataFormatError, match=r"da\.jsonl:3: invalid JSON"):
        read_conversations(FIXTURES / "da.jsonl", "daring_anteater", strict=True)


def test_strict_unknown_role_names_line(tmp_path):
    p = tmp_path / "x.jsonl"
    good = {"conversations": [{"from": "User", "value": "a"}, {"from": "Assistant", "value": "b"}]}
    bad = {"conversations": [{"from": "Robot", "value": "a"}, {"from": "Assistant", "value": "b"}]}
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataFormatError, match=r"x\.jsonl:2: turn 0: unknown role 'Robot'"):
        read_conversations(p, "daring_anteater", strict=True)


def test_sharegpt_json_list_and_system_turn():
    recs = read_conversations(FIXTURES / "sharegpt.json", "sharegpt")
    assert recs[0]["_where"] == "sharegpt.json:item 0"  # the reader's note of where it came from
    assert {k: v for k, v in recs[0].items() if not k.startswith("_")} == {"id": "sg-0", "system": "Be brief.",
                       "turns": [{"role": "user", "content": "Capital of France?"},
                                 {"role": "assistant", "content": "Paris."}]}
    assert len(recs) == 2


def test_messages_and_auto_detection():
    recs = read_conversations(FIXTURES / "messages.jsonl", "auto")
    assert recs[0]["system"] == "You answer in one word." and recs[1]["turns"][1]["content"] == "c a t"
    assert read_conversations(FIXTURES / "messages.jsonl", "messages") == recs


def test_text_directory_reads_only_text_suffixes():
    recs = read_conversations(FIXTURES / "text_dir", "text")
    assert sorted(r["id"].rsplit("/", 1)[-1] for r in recs) == ["a.txt", "b.md"]
    assert all(r["turns"] == [] and r["text"] for r in recs)


def test_empty_and_all_malformed_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(EmptyDatasetError, match="no usable records"):
        read_conversations(empty, "daring_anteater")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(EmptyDatasetError, match=r"skipped=1.*bad\.jsonl:1: missing 'conversations'"):
        read_conversations(bad, "daring_anteater")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_conversations(tmp_path / "nope.jsonl", "daring_anteater")
    with pytest.raises(DataFormatError, match="unknown data format 'csv'"):
        read_conversations(empty, "csv")


def _masked_text(tok, enc):
    ids = [i for i, m in zip(enc.input_ids.tolist(), enc.loss_mask.tolist()) if m]
    return "".join(tok.convert_ids_to_tokens(ids))


def test_default_template_masks_exactly_assistant_turns(tok):
    rec = {"id": "x", "system": None, "turns": [
        {"role": "user", "content": "what is one plus two?"}, {"role": "assistant", "content": "three."},
        {"role": "user", "content": "and two plus two?"}, {"role": "assistant", "content": "four."}]}
    enc = encode_chat(tok, rec, 512)
    assert _masked_text(tok, enc) == "three.<|im_end|>four.<|im_end|>"
    assert enc.loss_mask.sum() < enc.loss_mask.numel() and not enc.truncated
    enc_all = encode_chat(tok, rec, 512, loss_on="all")
    assert bool(enc_all.loss_mask.all()) and torch.equal(enc_all.input_ids, enc.input_ids)


def test_system_prompt_option_only_when_record_has_none(tok):
    rec = synthetic_chats(1)[0]
    assert rec["system"] is None
    text = render_chat(tok, [{"role": "system", "content": "be terse."}] + rec["turns"])
    ids = encode_chat(tok, rec, 512, system_prompt="be terse.").input_ids.tolist()
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    rec2 = dict(rec, system="own system.")
    dec = tok.decode(encode_chat(tok, rec2, 512, system_prompt="be terse.").input_ids)
    assert "ownsystem" in dec and "terse" not in dec


def test_tokenizer_own_jinja_template_used(tmp_path):
    tpl = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[inst] {{ m['content'] }} [/inst]"
           "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% else %}[sys] {{ m['content'] }}"
           "{% endif %}{% endfor %}")
    tiny_tokenizer(tmp_path / "tok", chat_template=tpl)
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.chat_template == tpl
    rec = {"id": "x", "system": "sys.", "turns": [{"role": "user", "content": "hi?"},
                                                    {"role": "assistant", "content": "yes."}]}
    enc = encode_chat(tok, rec, 512)
    toks = tok.convert_ids_to_tokens(enc.input_ids.tolist())
    assert toks[0] == "<s>" and "<|im_start|>" not in toks
    assert _masked_text(tok, enc) == "yes.<|im_end|>"


def test_template_is_sandboxed(tok):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="SecurityError|unsafe|access"):
        render_chat(tok, [{"role": "user", "content": "x"}], template=evil)
    boom = "{{ raise_exception('no system allowed') }}"
    with pytest.raises(ChatTemplateError, match="no system allowed"):
        render_chat(tok, [{"role": "user", "content": "x"}], template=boom)


def test_truncation_counted_and_prompt_helper(tok):
    recs = synthetic_chats(6)
    dm = SpecDataModule(DataConfig(path="unused", max_seq_len=24, val_fraction=0.0), tok, micro_batch_size=2,
                        records=recs)
    dm.setup()
    assert dm.stats.truncated == 6 and all(s.input_ids.numel() == 24 for s in dm.train_set.samples)
    ids = apply_chat_template(tok, recs[0]["turns"][:1])
    assert tok.convert_ids_to_tokens(ids)[-1] == "t" and tok.convert_ids_to_tokens(ids)[0] == "<|im_start|>"


def test_datamodule_reads_real_file_split_and_batches(tok, tmp_path):
    path = write_daring_anteater(synthetic_chats(40), tmp_path / "train.jsonl")
    cfg = DataConfig(path=str(path), format="daring_anteater", max_seq_len=64, val_fraction=0.1, seed=7)
    dm = SpecDataModule(cfg, tok, micro_batch_size=4)
    dm.setup()
    assert len(dm.train_set) == 36 and len(dm.val_set) == 4 and len(dm.val_records) == 4
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape == batch["loss_mask"].shape
    pad = batch["input_ids"] == tok.pad_token_id
    assert not bool((batch["loss_mask"].bool() & pad).any())
    prompts = dm.val_prompts(3)
    assert len(prompts) == 3 and all(tok.convert_ids_to_tokens(p)[-2:] == ["<|im_start|>", "assistant"] or
                                     tok.convert_ids_to_tokens(p)[-1].endswith("t") for p in prompts)


def test_validation_smaller_than_dp_is_refused(tok, tmp_path, monkeypatch):
    """4 validation samples over 8 DP ranks leave ranks without a batch, which would hang the others in the
    validation metrics' average over the DP ranks (and in the MoE dispatcher's collectives at EP > 1): refused by
    name, dense or MoE; 4 ranks each get a batch."""
    from nemo_spec import parallel
    from nemo_spec.config import ConfigError
    from nemo_spec.data import datamodule

    path = write_daring_anteater(synthetic_chats(40), tmp_path / "train.jsonl")
    cfg = DataConfig(path=str(path), format="daring_anteater", max_seq_len=64, val_fraction=0.1, seed=7)
    dm = SpecDataModule(cfg, tok, micro_batch_size=1)
    monkeypatch.setattr(datamodule, "data_parallel_rank_size", lambda: (3, 4))
    assert len(list(dm.val_dataloader())) == 1  # rank 3 of 4 takes one of the 4 samples
    for ep in (1, 2):
        monkeypatch.setattr(parallel, "ep_size", lambda ep=ep: ep)
        monkeypatch.setattr(datamodule, "data_parallel_rank_size", lambda: (0, 8))
        with pytest.raises(ConfigError, match="validation split has 4 samples, fewer than the 8 data-parallel ranks"):
            dm.val_dataloader()


def test_split_is_seeded_and_disjoint():
    a = split_indices(50, 0.2, 100, seed=3)
    assert a == split_indices(50, 0.2, 100, seed=3) and a != split_indices(50, 0.2, 100, seed=4)
    tr, va = a
    assert len(va) == 10 and not set(tr) & set(va) and sorted(tr + va) == list(range(50))


def test_dp_sampler_partitions_global_batches_and_resumes():
    full = [DataParallelBatchSampler(24, 3, r, 2, seed=1) for r in range(2)]
    for s in full:
        s.set_epoch(1)
    batches = [list(s) for s in full]
    assert len(batches[0]) == len(full[0]) == 4
    flat = sorted(i for b in batches for mb in b for i in mb)
    assert flat == list(range(24))
    # resume after 2 global batches (12 samples) with DP=1 and micro-batch 6 -> the same remaining samples
    one = DataParallelBatchSampler(24, 6, 0, 1, seed=1)
    one.set_epoch(1)
    one.skip_samples(12)
    rest = [sorted(mb) for mb in one]
    assert rest == [sorted(batches[0][k] + batches[1][k]) for k in (2, 3)]
    with pytest.raises(EmptyDatasetError, match="fewer than one global micro-batch"):
        DataParallelBatchSampler(3, 2, 0, 2)


def test_writer_roundtrip_is_atomic(tmp_path):
    recs = read_conversations(FIXTURES / "sharegpt.json", "sharegpt")
    out = write_daring_anteater(recs, tmp_path / "sub" / "out.jsonl")
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]
    back = read_conversations(out, "daring_anteater", strict=True)
    assert [(r["id"], r["system"], r["turns"]) for r in back] == [(r["id"], r["system"], r["turns"]) for r in recs]


def test_text_format_chunks_with_loss_on_all(tok):
    cfg = DataConfig(path=str(FIXTURES / "text_dir"), format="text", max_seq_len=16, loss_on="all",
                     val_fraction=0.5, seed=0)
    dm = SpecDataModule(cfg, tok, micro_batch_size=1)
    dm.setup()
    assert len(dm.train_set) >= 1 and len(dm.val_set) >= 1 and len(dm.val_records) == 1
    assert all(s.input_ids.numel() <= 16 and bool(s.loss_mask.all()) for s in dm.train_set.samples)
    prompts = dm.val_prompts(2)
    assert prompts and all(4 <= len(p) <= 8 for p in prompts)
    with pytest.raises(EmptyDatasetError, match="no files with suffix"):
        read_conversations(FIXTURES / "text_dir", "daring_anteater")


def test_record_opening_with_the_assistants_turn_encodes(tok):
    """A record whose first turn is the assistant's renders the generation prompt of an empty conversation to find
    that turn; rendering through transformers' apply_chat_template (which refuses no messages) broke such records."""
    rec = {"id": "a", "system": None, "turns": [{"role": "assistant", "content": "hello there."},
                                                 {"role": "user", "content": "hi?"},
                                                 {"role": "assistant", "content": "yes."}]}
    enc = encode_chat(tok, rec, 512)
    masked = tok.decode(enc.input_ids[enc.loss_mask.bool()])
    assert masked.replace(" ", "") == "hellothere.<|im_end|>yes.<|im_end|>"  # (this tokenizer decodes without spaces)


# ---- reading and encoding what users have (training review) -----------------------------------------------------
def test_compressed_files_and_unread_suffixes_are_named(tmp_path, caplog):
    """A .jsonl.gz given as the path was read as text: every line "invalid UTF-8"; inside a directory it was left
    out without a word."""
    import gzip
    import logging

    from nemo_spec.data.formats import write_messages

    plain = write_messages(synthetic_chats(3), tmp_path / "d" / "a.jsonl")
    gz = tmp_path / "d" / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    with pytest.raises(DataFormatError, match=r"b.jsonl.gz is gzip-compressed: decompress it first"):
        read_conversations(gz, "messages")
    with caplog.at_level(logging.WARNING):
        assert len(read_conversations(tmp_path / "d", "messages")) == 3
    assert "1 file(s) not read" in caplog.text and "b.jsonl.gz" in caplog.text


def test_a_pretty_printed_json_object_is_one_record(tmp_path):
    """It was read line by line: "skipped 30 malformed record(s) of 30"."""
    rec = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello to you"}]}
    f = tmp_path / "one.json"
    f.write_text(json.dumps(rec, indent=2))
    recs = read_conversations(f, "messages", strict=True)
    assert len(recs) == 1 and [t["role"] for t in recs[0]["turns"]] == ["user", "assistant"]


_THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
          "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_conversation_the_template_cannot_mark_is_skipped_or_named(tmp_path, caplog):
    """A Qwen3-style template drops earlier turns' <think> blocks, so a record with one cannot be located turn by
    turn: that one record ended the whole run (even with strict=false) without naming it."""
    import logging

    from nemo_spec.data.formats import write_messages

    recs = synthetic_chats(12, seed=4)
    bad = {"id": "thinker", "system": None, "turns": [
        {"role": "user", "content": "what is two"}, {"role": "assistant", "content": "<think>hmm</think>two"},
        {"role": "user", "content": "and three"}, {"role": "assistant", "content": "three"}]}
    path = write_messages(recs + [bad], tmp_path / "c.jsonl")
    tok = tiny_tokenizer(chat_template=_THINK)
    dm = SpecDataModule(DataConfig(path=str(path), format="messages", max_seq_len=256, val_fraction=0.0), tok)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert dm.stats.template_errors == 1 and len(dm.train_set) == 12
    assert "1 conversation(s) skipped" in caplog.text and "c.jsonl:13" in caplog.text
    strict = SpecDataModule(DataConfig(path=str(path), format="messages", max_seq_len=256, val_fraction=0.0,
                                       strict=True), tok)
    with pytest.raises(ChatTemplateError, match=r"c.jsonl:13: chat template output is not prefix-stable"):
        strict.setup()


def test_short_text_documents_are_counted(tmp_path, caplog):
    """Text files under 8 tokens were dropped without a log line; when all were, the error blamed assistant
    tokens."""
    d = tmp_path / "t"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text("hi")
    dm = SpecDataModule(DataConfig(path=str(d), format="text", max_seq_len=64, val_fraction=0.0), tiny_tokenizer())
    with pytest.raises(EmptyDatasetError, match=r"3 text document\(s\) shorter than 8 tokens"):
        dm.setup()
