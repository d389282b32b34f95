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
