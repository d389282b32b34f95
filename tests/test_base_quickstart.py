"""Quickstart pipeline: stage availability, clear errors for missing stages, config validation (no heavy work)."""
import pytest

from nemo_spec.base import quickstart as Q
from nemo_spec.config import ConfigError


def test_all_stages_available_in_this_checkout():
    for stage in Q.STAGES:
        assert Q.stage_available(stage) is None, stage
    with pytest.raises(ConfigError, match="unknown quickstart stage 'deploy'"):
        Q.stage_available("deploy")


def test_missing_stage_named_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setitem(Q.STAGE_REQUIREMENTS, "speculate", ("nemo_spec.no_such_module", None))
    assert "nemo_spec.no_such_module" in Q.stage_available("speculate")
    cfg = Q.QuickstartConfig(preset="tiny", cache_dir=str(tmp_path), stages=["speculate", "train"])
    with pytest.raises(Q.QuickstartError, match="stopped before stage 'speculate'.*nemo_spec.no_such_module"):
        Q.run_quickstart(cfg)
    assert not (tmp_path / "base").exists()  # nothing was built
    monkeypatch.setitem(Q.STAGE_REQUIREMENTS, "export", ("nemo_spec.export.cli", "scripts/no_such_script.py"))
    assert "scripts/no_such_script.py" in Q.stage_available("export")


def test_stage_needs_base_and_config_validation(tmp_path):
    with pytest.raises(Q.QuickstartError, match="needs the 'base' stage"):
        Q.run_quickstart(Q.QuickstartConfig(preset="tiny", cache_dir=str(tmp_path), stages=["data"]))
    with pytest.raises(ConfigError, match=r"stages \['deploy'\] unknown"):
        Q.QuickstartConfig(stages=["base", "deploy"]).validate()
    with pytest.raises(ConfigError, match="train_steps must be a positive int"):
        Q.QuickstartConfig(train_steps=0).validate()
    with pytest.raises(ConfigError, match="extra has unknown stage"):
        Q.QuickstartConfig(extra={"nope": ["x"]}).validate()


def test_cli_reports_missing_stage(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(Q.STAGE_REQUIREMENTS, "speculate", ("nemo_spec.no_such_module", None))
    rc = Q.main(["--preset", "tiny", "--cache_dir", str(tmp_path), "--stages", "speculate"])
    assert rc == 2
    assert "stopped before stage 'speculate'" in capsys.readouterr().err
