"""Pretrained quickstart bases (SmolLM2): docstring chat requests, config checks, the GGUF base cached from a file."""
import json

import pytest

from nemo_spec.base import quickstart as Q
from nemo_spec.base.pretrained import _third_person, docstring_tasks, write_chat_requests
from nemo_spec.config import ConfigError

SRC = '''
def urlsafe_b64encode(s):
    """Encode bytes using the URL- and filesystem-safe Base64 alphabet.

    More text.
    """

def copy(x, y=1):
    """Copy x into y."""

def _private():
    """Return nothing useful here."""

class K:
    def method(self):
        """Return the method's value."""

def short():
    """Do it."""

def matches(a):
    """Returns True when a matches."""
'''


def test_docstring_tasks_are_module_level_functions_with_a_verb_phrase():
    tasks = docstring_tasks([SRC, "def broken(:\n"], n=10)
    assert sorted(tasks) == sorted([
        "Write a Python function `urlsafe_b64encode(s)` that encodes bytes using the URL- and filesystem-safe "
        "Base64 alphabet.",
        "Write a Python function `copy(x, y)` that copies x into y.",
        "Write a Python function `matches(a)` that returns True when a matches."])
    assert [_third_person(v) for v in ("Return", "Match", "Copy", "Pass", "Returns", "Say")] == \
        ["returns", "matches", "copies", "passes", "returns", "says"]


def test_chat_requests_are_messages_with_an_empty_answer_for_generate_data(tmp_path):
    from nemo_spec.data import read_conversations

    f = write_chat_requests(["Write a Python function `f()` that returns 1."], tmp_path / "req.jsonl", "train")
    rec = read_conversations(str(f), "messages")[0]
    assert rec["id"] == "train-0" and [t["role"] for t in rec["turns"]] == ["user", "assistant"]
    assert json.loads(f.read_text())["messages"][1]["content"] == ""


def test_quickstart_config_for_pretrained_bases():
    cfg = Q.QuickstartConfig(base="smollm2").validate()
    assert "distill" in cfg.stages and cfg.stages.index("distill") == cfg.stages.index("data") + 1
    assert "distill" not in Q.QuickstartConfig().validate().stages
    with pytest.raises(ConfigError, match="needs a pretrained base"):
        Q.QuickstartConfig(stages=["base", "distill"]).validate()
    with pytest.raises(ConfigError, match="base must be one of"):
        Q.QuickstartConfig(base="gpt5").validate()
    args = Q.build_parser().parse_args(["--base", "smollm2", "--train_lr", "5e-4"])
    c = Q.config_from_args(args)
    assert (c.draft_vocab_size, c.train_steps, c.train_lr, c.num_prompts, c.code_max_bytes) == \
        (8192, 240, 5e-4, 8, 2_000_000)
    c = Q.config_from_args(Q.build_parser().parse_args(["--base", "smollm2", "--train_steps", "7"]))
    assert (c.train_steps, c.draft_vocab_size) == (7, 8192)
    c = Q.config_from_args(Q.build_parser().parse_args([]))
    assert (c.base, c.draft_vocab_size, c.train_steps, c.train_lr, c.num_prompts, c.stages) == \
        ("builtin", None, 200, 3e-3, 16, None)
