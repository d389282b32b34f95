from setuptools import find_packages, setup

setup(
    name="nemo_spec",
    version="0.1.0",
    description="Speculative decoding (EAGLE-1, EAGLE-3, Medusa) for megatron-core GPT models",
    packages=find_packages(include=["nemo_spec", "nemo_spec.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",  # CPU: install torch==2.13.0 first (see README); GPU: bring your CUDA build
        "megatron-core>=0.15,<0.17",  # 0.16.x (make test) and 0.15.x (make test-nemo) are both tested
        "lightning>=2.4,<2.7",
        "hydra-core>=1.3,<1.4",
        "transformers>=4.50",
        "safetensors",
        "tokenizers",
        "jinja2",
        "psutil",
        "tqdm",
        "numpy",
    ],
    extras_require={
        "serve": ["fastapi", "uvicorn", "pydantic>=2", "httpx", "openai"],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "openai", "matplotlib", "tensorboard", "fastapi", "uvicorn", "httpx", "gguf>=0.10",
                "accelerate"],
        # NeMo 2.7.3's optimizer needs megatron-core 0.15.x; the tested set is tests/nemo/requirements.txt
        "nemo": ["nemo_toolkit[llm]>=2.7,<2.8", "megatron-core>=0.15,<0.16"],
        # GGUF import (llama.cpp files); accelerate only for transformers' own GGUF loading in the parity tests
        "gguf": ["gguf>=0.10", "accelerate"],
    },
    # the few-row CPU kernel's source, compiled on first use (nemo_spec/models/skinny_gemm.py)
    package_data={"nemo_spec": ["models/skinny_gemm.cpp"]},
    include_package_data=True,
)
