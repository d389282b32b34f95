"""Run the app under uvicorn: in the foreground (scripts/serve.py) or in a background thread (tests, benchmarks)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Optional

import uvicorn

from nemo_spec.serve.app import create_app
from nemo_spec.serve.config import ServeConfig
from nemo_spec.serve.models import ModelManager

log = logging.getLogger(__name__)


def run_server(cfg: ServeConfig) -> None:
    """Load the configured models and serve until interrupted (blocking)."""
    from nemo_spec import parallel

    cfg.validate()
    parallel.initialize(tensor_parallel_size=1)
    app = create_app(cfg)
    log.info("serving %s on http://%s:%d", app.state.manager.names(), cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=10)


class ServerThread:
    """A uvicorn server on ``host`` (random free port) in a daemon thread; use as a context manager."""

    def __init__(self, cfg: ServeConfig, manager: Optional[ModelManager] = None, host: str = "127.0.0.1",
                 log_level: str = "warning") -> None:
        self.app = create_app(cfg, manager)
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="uvicorn")

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT."""
        return f"http://{self.host}:{self.port}"

    @property
    def manager(self) -> ModelManager:
        """The app's model manager."""
        return self.app.state.manager

    def start(self, timeout: float = 30.0) -> "ServerThread":
        """Start serving; returns once uvicorn accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit, wait for it, and unload the models."""
        self.server.should_exit = True
        self._thread.join(min(timeout, 2.0))
        if self._thread.is_alive():  # still waiting on open keep-alive connections: stop now
            self.server.force_exit = True
            self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            log.warning("uvicorn thread did not stop within %.0fs", timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
