from nemo_spec.checkpoint import tp  # noqa: F401
