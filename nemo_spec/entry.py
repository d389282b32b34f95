"""What every command-line entry point (scripts/*.py) shares: quiet expected fallbacks, one-line user errors.

* megatron-core warns at import time that Transformer Engine / Apex are missing and it falls back to torch
  implementations. On CPU and for this project's layer spec that is expected, so entry points log each such
  message once at debug level instead of printing it; every other warning is shown as usual.
* A known user error (a bad config, checkpoint, data file, option ...: the project's own exception types)
  prints one line naming the problem and exits with code 2. ``--debug`` (or ``HYDRA_FULL_ERROR=1`` /
  ``NEMO_SPEC_DEBUG=1``) shows the full traceback instead.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import sys
import warnings
from typing import Any, Callable, Tuple, Type, TypeVar

log = logging.getLogger("nemo_spec")

F = TypeVar("F", bound=Callable[..., Any])

#: megatron-core's messages for optional accelerated kernels it replaces with torch code when they are absent
EXPECTED_FALLBACKS = re.compile(r"(Transformer Engine and Apex are not installed|Apex is not installed|"
                                r"Transformer Engine is not installed)")
DEBUG_ENV = ("NEMO_SPEC_DEBUG", "HYDRA_FULL_ERROR")
_installed = False


def quiet_expected_fallbacks() -> None:
    """Route megatron's Transformer Engine / Apex fallback warnings to one debug log line each (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    show = warnings.showwarning
    seen = set()

    def showwarning(message: Any, category: Type[Warning], filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        text = str(message)
        if EXPECTED_FALLBACKS.search(text):
            if text not in seen:
                seen.add(text)
                log.debug("expected fallback (%s:%d): %s", filename, lineno, text)
            return
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def debug_requested() -> bool:
    """True when the user asked for full tracebacks (--debug on the command line or a debug variable)."""
    return any(os.environ.get(k, "") not in ("", "0") for k in DEBUG_ENV)


def take_debug_flag() -> None:
    """Remove ``--debug`` from sys.argv (argparse / Hydra never see it) and remember it in NEMO_SPEC_DEBUG."""
    if "--debug" in sys.argv[1:]:
        sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a != "--debug"]
        os.environ["NEMO_SPEC_DEBUG"] = "1"


def user_error_types() -> Tuple[Type[BaseException], ...]:
    """The project's exception types that mean 'your input is wrong' (imported lazily)."""
    from nemo_spec.base.build import BuildError
    from nemo_spec.base.corpus import CorpusError
    from nemo_spec.base.quickstart import QuickstartError
    from nemo_spec.base.tokenizer import TokenizerError
    from nemo_spec.checkpoint.megatron import CheckpointError
    from nemo_spec.config import ConfigError
    from nemo_spec.data.chat import ChatTemplateError as DataChatTemplateError
    from nemo_spec.data.formats import DataFormatError
    from nemo_spec.datagen import DatagenError
    from nemo_spec.export.formats import ExportError
    from nemo_spec.inference.sampling import SamplingError
    from nemo_spec.serve.chat_template import ChatTemplateError
    from nemo_spec.serve.models import ModelLoadError
    from nemo_spec.training.offline import OfflineDataError

    return (BuildError, CorpusError, QuickstartError, TokenizerError, CheckpointError, ConfigError,
            DataChatTemplateError, DataFormatError, DatagenError, ExportError, SamplingError, ChatTemplateError,
            ModelLoadError, OfflineDataError, FileNotFoundError, FileExistsError)


def print_user_error(e: BaseException) -> None:
    """The one-line report of a user error on stderr (with the --debug hint); for entry points that return their
    exit code instead of raising (callers re-raise first when :func:`debug_requested`)."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    print("(run with --debug for the full traceback)", file=sys.stderr, flush=True)


def report_user_errors(fn: F) -> F:
    """Decorate an entry point: a user error prints ``error: <message>`` on stderr and exits 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if debug_requested() or not isinstance(e, user_error_types()):
                raise
            print_user_error(e)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


def setup() -> None:
    """First thing in every script: quiet expected fallbacks and take ``--debug`` off the command line."""
    quiet_expected_fallbacks()
    take_debug_flag()
