"""Run the app under uvicorn: in the foreground (scripts/serve.py) or in a background thread (tests, benchmarks)."""
from __future__ import annotations

import asyncio
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


#: after the drain time, aborted streams need a moment to send their last event and close
_CLOSE_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server with a drain on shutdown (SIGTERM/SIGINT): stop accepting, answer queued requests with
    503 at once, give running generations ``shutdown_drain_s``, then end each with an error event, so every
    open stream ends with a final event and ``[DONE]`` and every non-streamed request gets a JSON answer."""

    def __init__(self, app: Any, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.nemo_app = app

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        """Drain, then uvicorn's own shutdown (close connections, lifespan shutdown unloads the models)."""
        drain_s = float(self.nemo_app.state.config.shutdown_drain_s)
        begin_shutdown(self.nemo_app)
        timer = asyncio.get_running_loop().call_later(drain_s, self.nemo_app.state.manager.abort_running)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def begin_shutdown(app: Any) -> None:
    """Refuse new generation requests (503 server_shutdown) and answer every queued one with 503."""
    if not app.state.shutting_down:
        app.state.shutting_down = True
        log.info("shutting down: queued requests get 503, running ones have %.1fs to finish",
                 app.state.config.shutdown_drain_s)
        app.state.manager.begin_shutdown()


def _server(app: Any, cfg: ServeConfig, **kw: Any) -> GracefulServer:
    config = uvicorn.Config(app, timeout_graceful_shutdown=int(cfg.shutdown_drain_s + _CLOSE_GRACE_S) + 1, **kw)
    return GracefulServer(app, config)


def run_server(cfg: ServeConfig) -> None:
    """Load the configured models and serve until interrupted (blocking); SIGTERM drains (see GracefulServer)."""
    from nemo_spec import parallel

    cfg.validate()
    parallel.initialize(tensor_parallel_size=1)
    app = create_app(cfg)
    log.info("serving %s on http://%s:%d", app.state.manager.names(), cfg.host, cfg.port)
    _server(app, cfg, host=cfg.host, port=cfg.port, log_level=cfg.log_level).run()


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
        self.server = _server(self.app, cfg, log_level=log_level)
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
