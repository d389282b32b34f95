"""NeMo 2 integration: ``llm.train(..., model_transform=SpeculativeTransform(...))`` trains the draft.

Importable only where NeMo 2 (``nemo_toolkit[llm]`` 2.7.x) is installed::

    from nemo.collections import llm
    from nemo_spec.integrations.nemo import SpeculativeTransform

    llm.train(model=model, data=data, trainer=trainer,
              model_transform=SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0))

NeMo applies a plain ``model_transform`` callable at ``on_train_epoch_start``
(nemo/lightning/pytorch/callbacks/model_transform.py ``ModelTransform.on_train_epoch_start``), after
``MegatronStrategy.setup`` wrapped the model in DDP and built the optimizer (megatron_strategy.py
``setup_megatron_parallel``): a draft added then is never optimised. This class is a NeMo ``ModelTransform``
callback (``llm.train`` registers it as one, api.py ``_setup``) that attaches the draft right after the
LightningModule's ``configure_model`` builds the megatron module, i.e. before DDP, the optimizer and any
checkpoint restore: the optimizer holds exactly the draft, NeMo's checkpoints hold base + draft and resume.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict

import torch

def _installed_nemo() -> str:
    from importlib import metadata

    try:
        return metadata.version("nemo_toolkit")
    except metadata.PackageNotFoundError:
        return ""


try:
    from nemo.lightning.pytorch.callbacks.model_transform import ModelTransform
except ImportError as e:  # pragma: no cover - exercised where NeMo is absent
    _version = _installed_nemo()
    _nemo3 = (" NeMo 3 removed the LLM collection (llm.train) and moved LLM training to Megatron Bridge, whose "
              "checkpoints nemo_spec's load_model reads (README 'Megatron Bridge checkpoints')."
              if _version and int(_version.split(".")[0]) >= 3 else "")
    raise ImportError(
        f"nemo_spec.integrations.nemo needs NeMo 2's LLM collection (nemo_toolkit[llm] 2.7.x; installed: "
        f"{_version or 'none'}).{_nemo3} See README 'NeMo 2' for the tested pins ({e})") from e

from nemo_spec import parallel
from nemo_spec.checkpoint.nemo2 import CHECKPOINT_KEY, draft_modules
from nemo_spec.config import ConfigError
from nemo_spec.models.gpt import unwrap_speculative
from nemo_spec.speculative.transform import SpeculativeTransform as _BaseTransform

log = logging.getLogger(__name__)

__all__ = ["SpeculativeTransform"]


class SpeculativeTransform(_BaseTransform, ModelTransform):
    """:class:`nemo_spec.speculative.SpeculativeTransform` as a NeMo 2 ``model_transform`` (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _BaseTransform.__init__(self, *args, **kwargs)
        ModelTransform.__init__(self)

    # Lightning runs callbacks' setup before LightningModule.configure_model (trainer.py _run: _call_setup_hook,
    # then _call_configure_model, then strategy.setup), so wrapping configure_model here attaches the draft as
    # soon as NeMo builds its megatron module. Whether a module has its draft is asked of the module itself: one
    # transform object may serve several llm.train calls (a notebook re-run, a second model).
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Arrange for the draft to be attached right after ``pl_module.configure_model``, and for a restore of a
        base checkpoint (NeMo's ``RestoreConfig``) to leave the draft out."""
        self._restore_base_only(trainer)
        self._record_draft_on_save(trainer)
        pl_module._nemo_spec_transform = self  # the transform of this fit (a later llm.train may pass another)

        def configure_model(original: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                pl_module._nemo_spec_transform._attach(pl_module)
                return out
            return wrapped

        _wrap_once(pl_module, "configure_model", configure_model)
        if hasattr(pl_module, "module"):  # already configured (built by hand, or trained by an earlier llm.train)
            self._attach(pl_module)

    @staticmethod
    def _restore_base_only(trainer: Any) -> None:
        """``MegatronStrategy.selective_restore`` (RestoreConfig: how NeMo starts from a pretrained or
        ``llm.import_ckpt``-ed model, megatron_strategy.py:611, 1228-1250) loads strictly the sharded state dict of
        the whole module, draft included; a base checkpoint holds no draft, so it failed with "module.eagle_module.
        fc.weight from model not in state dict". When the checkpoint has no draft tensors, restore the base alone
        (the draft keeps its initialisation; every base tensor is still required); a checkpoint with the draft
        restores it too."""
        strategy = getattr(trainer, "strategy", None)

        def selective_restore(original: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                spec = unwrap_speculative(trainer.lightning_module)
                config = getattr(strategy, "restore_config", None)
                if spec is None or config is None or _holds_draft(config.path, spec.draft_prefix):
                    return original(*args, **kwargs)
                log.info("nemo_spec: %s holds no %sdraft: restoring the base only (the draft keeps its "
                         "initialisation)", config.path, spec.draft_prefix)
                with spec.base_only():
                    return original(*args, **kwargs)
            return wrapped

        _wrap_once(strategy, "selective_restore", selective_restore)

    @staticmethod
    def _record_draft_on_save(trainer: Any) -> None:
        """Record the draft's settings in every NeMo checkpoint (its common state, ``weights/common.pt``): with them
        ``nemo_spec.checkpoint.load_model`` rebuilds base + draft from the checkpoint alone (the tensors are there as
        ``module.eagle_module.*`` / ``module.medusa_heads.*``; without the settings a draft trained in a job that has
        ended could not be recovered). Written at ``strategy.save_checkpoint``: callbacks' ``on_save_checkpoint`` is
        skipped for weights-only saves, which NeMo's ModelCheckpoint makes at the end of training unless
        ``save_optim_on_train_end``."""
        def save_checkpoint(original: Any) -> Any:
            def wrapped(checkpoint: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
                spec = unwrap_speculative(trainer.lightning_module)
                if spec is not None:
                    checkpoint[CHECKPOINT_KEY] = {"speculative": spec.spec_config.to_dict()}
                return original(checkpoint, *args, **kwargs)
            return wrapped

        _wrap_once(getattr(trainer, "strategy", None), "save_checkpoint", save_checkpoint)

    def _attach(self, pl_module: Any) -> None:
        if unwrap_speculative(pl_module) is not None:  # a draft from an earlier fit: the same one, or ConfigError
            _BaseTransform.__call__(self, pl_module)
            return
        if not hasattr(pl_module, "module"):
            raise ConfigError(f"{type(pl_module).__name__}.configure_model did not create .module; "
                              "SpeculativeTransform needs NeMo's megatron module")
        _BaseTransform.__call__(self, pl_module)
        spec = unwrap_speculative(pl_module)
        if spec is None:
            raise ConfigError(f"no SpeculativeGPT inside {type(pl_module).__name__} after the transform")
        if parallel.sum_tp_partial_grads_in_finalize(pl_module, spec):
            log.info("nemo_spec: NeMo's finalize_model_grads also sums the draft's q/k-norm gradients over TP")
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        log.info("nemo_spec: %s draft attached to %s before DDP/optimizer: %d trainable parameters (draft only)",
                 spec.algorithm, type(pl_module).__name__, trainable)

    def __call__(self, model: torch.nn.Module) -> torch.nn.Module:
        """Used as a plain callable (or by NeMo's own hook): attach the draft, refusing after the optimizer exists."""
        if unwrap_speculative(model) is not None:
            return model
        trainer = getattr(model, "_trainer", None) or getattr(getattr(model, "trainer", None), "__self__", None)
        if trainer is not None and getattr(trainer, "optimizers", None):
            raise ConfigError("SpeculativeTransform applied after the optimizer was built: the draft would never "
                              "train. Pass it as llm.train(..., model_transform=SpeculativeTransform(...)) so it "
                              "runs at configure_model")
        return _BaseTransform.__call__(self, model)

    # NeMo's ModelTransform applies the transform at epoch start; ours is already attached by then
    def _maybe_apply_transform(self, trainer: Any) -> None:
        if unwrap_speculative(trainer.lightning_module) is None:
            raise ConfigError("SpeculativeTransform was not applied at configure_model (was it registered as a "
                              "callback before trainer.fit? pass it to llm.train(model_transform=...))")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the draft is attached and is what the optimizer holds."""
        self._maybe_apply_transform(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Tell the draft which optimizer step it trains (P-EAGLE's ``depth_warmup_steps``)."""
        spec = unwrap_speculative(pl_module)
        if spec is not None:
            spec.train_step = trainer.global_step

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the draft is attached."""
        self._maybe_apply_transform(trainer)


def _wrap_once(obj: Any, name: str, wrap: Any) -> None:
    """Replace the method ``obj.<name>`` (if it exists) by ``wrap(original)`` once: a method already wrapped by
    nemo_spec (a second setup of the same trainer or module) is left as it is."""
    original = getattr(obj, name, None)
    if original is None or getattr(original, "_nemo_spec_wrapped", False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    wrapped._nemo_spec_wrapped = True
    setattr(obj, name, wrapped)


def _holds_draft(path: Any, prefix: str) -> bool:
    """Whether the NeMo checkpoint at ``path`` (its ``weights/`` or the dist checkpoint itself) stores ``prefix``
    tensors (``module.eagle_module.*`` / ``module.medusa_heads.*``); True when it cannot tell (the strict load then
    decides, as before)."""
    from pathlib import Path

    p = Path(str(path))
    for d in (p / "weights", p):
        if (d / "metadata.json").is_file():
            try:
                return prefix.rstrip(".") in draft_modules(d)
            except Exception:  # an unreadable checkpoint: let NeMo's own load report it
                return True
    return True
