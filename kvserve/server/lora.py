"""LoRA adapters on the HTTP side (no torch): ``--lora-modules`` items, which adapter a
request's ``model`` selects, the ``/v1/models`` cards, and the bodies of
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's API).

The HTTP process never reads adapter files: the engine process loads and checks them
and answers with its list of adapters, which ``EngineClient.adapters`` keeps. Model
selection (``select_adapter``):

- no model, or a name or alias of the base model -> the base model (None);
- the name of a loaded adapter -> that adapter;
- ``<base>:<adapter>`` (SGLang / Ray Serve form; ``<base>`` any base name or alias) ->
  that adapter;
- anything else -> 404 ``model_not_found``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping

from kvserve.errors import InvalidRequestError
from kvserve.server.errors import ModelNotFoundError

MAX_NAME_CHARS = 256                 # as the request's model field
_LISTED_IN_ERRORS = 8                # adapter names a 404 message lists at most


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` item: load the PEFT folder ``path`` as ``name`` at start."""

    name: str
    path: str
    base_model_name: str | None = None      # vLLM's JSON form may name the base it was made for


def parse_lora_module(item: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``
    (ValueError naming the item otherwise)."""
    text = item.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {item!r}: not valid JSON ({exc})") from None
        extra = sorted(set(raw) - {"name", "path", "base_model_name"}) if isinstance(raw, dict) else []
        if not isinstance(raw, dict) or extra or not all(isinstance(raw.get(k), str) for k in ("name", "path")):
            raise ValueError(f"--lora-modules {item!r}: expected {{\"name\": str, \"path\": str}} "
                             f"(optional \"base_model_name\"){'; unknown key ' + repr(extra[0]) if extra else ''}")
        base = raw.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {item!r}: base_model_name must be a string")
        return LoRAModule(raw["name"], raw["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
    return LoRAModule(name, path)


def check_adapter_name(name: object, base_aliases: Iterable[str], param: str = "lora_name") -> str:
    """A name an adapter may be loaded under: a non-empty string of at most 256 characters
    that is not a name of the base model (it would never be selected)."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise InvalidRequestError(f"{param} must be a non-empty string of at most {MAX_NAME_CHARS} characters",
                                  param=param)
    if name in set(base_aliases):
        raise InvalidRequestError(f"{param} {name!r} is a name of the base model; choose another", param=param)
    return name


def lora_modules_config(items: Iterable[str] | None, base_aliases: Iterable[str]) -> dict[str, str]:
    """``--lora-modules`` items as the engine's ``lora_modules`` ({name: path}, in order);
    ValueError for a malformed item, a duplicate name, a base-model name or a
    ``base_model_name`` this server does not serve."""
    aliases = frozenset(base_aliases)
    modules: dict[str, str] = {}
    for item in items or ():
        module = parse_lora_module(item)
        try:
            check_adapter_name(module.name, aliases, param="--lora-modules")
        except InvalidRequestError as err:
            raise ValueError(err.message) from None
        if module.name in modules:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        if module.base_model_name is not None and module.base_model_name not in aliases:
            raise ValueError(f"--lora-modules {module.name!r}: base_model_name {module.base_model_name!r} "
                             "is not the model this server serves")
        modules[module.name] = module.path
    return modules


def select_adapter(model: str | None, base_name: str, base_aliases: frozenset[str],
                   adapters: Mapping[str, object]) -> str | None:
    """The adapter a request's ``model`` selects (None: the base model); 404 if none."""
    if model is None or model in base_aliases:
        return None
    if model in adapters:
        return model
    for i, char in enumerate(model):                 # <base>:<adapter>; a base alias may hold ':'
        if char == ":" and model[:i] in base_aliases and model[i + 1:] in adapters:
            return model[i + 1:]
    served = f"this server serves {base_name!r}"
    if adapters:
        names = sorted(adapters)
        shown = ", ".join(repr(n) for n in names[:_LISTED_IN_ERRORS])
        served += f" and the LoRA adapters {shown}" + (" ..." if len(names) > _LISTED_IN_ERRORS else "")
    raise ModelNotFoundError(f"the model {model!r} does not exist; {served}", param="model")


def adapter_cards(adapters: Mapping[str, dict], base_name: str, max_model_len: int | None) -> list[dict]:
    """``/v1/models`` entries of the loaded adapters (vLLM's shape: ``root`` is the
    adapter's folder, ``parent`` the base model's id)."""
    return [{"id": name, "object": "model", "created": int(a.get("created", 0)), "owned_by": "kvserve",
             "root": a.get("path"), "parent": base_name, "max_model_len": max_model_len}
            for name, a in adapters.items()]


def _string_field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} is required and must be a non-empty string", param=name)
    return value


def _check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidRequestError(f"unknown or unsupported field {unknown[0]!r}", param=unknown[0],
                                  code="unknown_parameter")


def parse_load_body(body: dict, base_aliases: Iterable[str]) -> tuple[str, str]:
    """``/v1/load_lora_adapter``: ``{"lora_name", "lora_path"}`` -> (name, path)."""
    _check_fields(body, ("lora_name", "lora_path"))
    name = check_adapter_name(_string_field(body, "lora_name"), base_aliases)
    return name, _string_field(body, "lora_path")


def parse_unload_body(body: dict) -> str:
    """``/v1/unload_lora_adapter``: ``{"lora_name"}`` -> name (names identify adapters
    here, so vLLM's ``lora_int_id`` is refused as an unknown field)."""
    _check_fields(body, ("lora_name",))
    return _string_field(body, "lora_name")
