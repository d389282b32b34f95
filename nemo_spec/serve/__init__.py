"""OpenAI-compatible serving: FastAPI app, protocol models, dynamic batching, chat templates, metrics."""
from nemo_spec.serve.config import ModelSpec, ServeConfig
from nemo_spec.serve.protocol import APIError

__all__ = ["ModelSpec", "ServeConfig", "APIError", "create_app", "ModelManager", "ServerThread", "run_server"]


def __getattr__(name: str):  # lazy: importing the package does not pull in torch/fastapi
    if name == "create_app":
        from nemo_spec.serve.app import create_app
        return create_app
    if name == "ModelManager":
        from nemo_spec.serve.models import ModelManager
        return ModelManager
    if name in ("ServerThread", "run_server"):
        from nemo_spec.serve import server
        return getattr(server, name)
    raise AttributeError(name)
