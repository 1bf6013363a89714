"""The tenants file (``kvserve serve --tenants FILE``, TOML or YAML): who may call the
server, with which keys, how much, in which class, and which guards see their traffic.

Shape (``examples/tenants.toml`` is a commented, working example)::

    admin_keys = ["..."]                 # keys of the admin routes (and /metrics)
    audit_log = "audit.jsonl"            # optional: one JSON line per request
    [guards.NAME]  ...                   # guard definitions (kvserve/guards/config.py)
    [tenants.NAME]
    keys = ["..."]                       # at least one
    weight = 1.0                         # fair share of the engine (tokens served)
    service_class = "chat"               # optional pin: interactive | chat | batch (or a tier name)
    models = ["*"]                       # models / LoRA adapters it may use ("*": all)
    guards = ["NAME", ...]               # guards run on its requests
    audit_text = false                   # the audit log may keep its prompts and outputs
    [tenants.NAME.limits]                # every limit optional (absent: unlimited)
    requests_per_min, tokens_per_min, max_concurrent_requests, max_prompt_tokens,
    default_max_tokens, max_tokens

A file that cannot be used is a ``TenantsFileError`` naming the file and the field path
(and the line, for a syntax error): the server refuses to start.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from kvserve.engine.service_class import ServiceClass, parse_class

TOP_LEVEL_FIELDS = frozenset({"admin_keys", "audit_log", "guards", "tenants"})
TENANT_FIELDS = frozenset({"keys", "weight", "service_class", "models", "guards", "audit_text", "limits"})
LIMIT_FIELDS = ("requests_per_min", "tokens_per_min", "max_concurrent_requests", "max_prompt_tokens",
                "default_max_tokens", "max_tokens")
ALL_MODELS = "*"


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None = unlimited. Rates are per minute, enforced in the HTTP
    process before the engine sees a request (``rate_limit.py``)."""

    requests_per_min: int | None = None
    tokens_per_min: int | None = None          # prompt + max_tokens reserved, settled to actual
    max_concurrent_requests: int | None = None
    max_prompt_tokens: int | None = None
    default_max_tokens: int | None = None      # a request without max_tokens gets this
    max_tokens: int | None = None              # the most max_tokens a request may ask


@dataclass(frozen=True)
class Tenant:
    """One tenant of the tenants file."""

    name: str
    keys: tuple[str, ...]
    weight: float = 1.0
    service_class: ServiceClass | None = None
    models: frozenset[str] = frozenset({ALL_MODELS})
    guards: tuple[str, ...] = ()
    audit_text: bool = False
    limits: TenantLimits = field(default_factory=TenantLimits)

    def may_use(self, model: str) -> bool:
        """Whether the tenant may send ``model`` (a served model id or an adapter name)."""
        return ALL_MODELS in self.models or model in self.models


@dataclass(frozen=True)
class TenantsConfig:
    """The whole file, checked."""

    tenants: dict[str, Tenant]
    admin_keys: tuple[str, ...] = ()
    guards: dict[str, dict] = field(default_factory=dict)    # name -> guard table (kvserve/guards/config.py)
    audit_log: str | None = None

    def weights(self) -> dict[str, float]:
        """Tenant -> fair-share weight (for the engine's fair-share policy)."""
        return {name: tenant.weight for name, tenant in self.tenants.items()}


def load_tenants(path: str) -> TenantsConfig:
    """Read and check a tenants file (``.toml``, or ``.yaml`` / ``.yml``)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TenantsFileError(f"{path}: cannot read the tenants file: {exc.strerror}") from None
    data = _parse(raw, path)
    return parse_tenants(data, path)


def _parse(raw: bytes, path: str) -> dict:
    """The file's top-level table; syntax errors name the line."""
    if os.path.splitext(path)[1].lower() in (".yaml", ".yml"):
        import yaml
        try:
            data = yaml.safe_load(raw.decode("utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise TenantsFileError(f"{path}: not valid YAML: {exc}") from None
    else:
        import tomllib
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise TenantsFileError(f"{path}: not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise TenantsFileError(f"{path}: expected a table at the top level")
    return data


def parse_tenants(data: dict, path: str = "<tenants>") -> TenantsConfig:
    """A checked ``TenantsConfig`` from the parsed file; errors name ``path`` and the field."""
    _no_unknown(data, TOP_LEVEL_FIELDS, "", path)
    admin_keys = tuple(_keys(data.get("admin_keys", []), "admin_keys", path, allow_empty=True))
    guards = _table(data.get("guards", {}), "guards", path)
    for name, spec in guards.items():
        _table(spec, f"guards.{name}", path)
    tenants_table = _table(data.get("tenants"), "tenants", path)
    if not tenants_table:
        raise TenantsFileError(f"{path}: tenants: at least one tenant is needed")
    tenants = {name: _tenant(name, spec, guards, path) for name, spec in tenants_table.items()}
    _check_unique_keys(tenants, admin_keys, path)
    audit_log = data.get("audit_log")
    if audit_log is not None and (not isinstance(audit_log, str) or not audit_log.strip()):
        raise TenantsFileError(f"{path}: audit_log: expected a file path")
    return TenantsConfig(tenants, admin_keys, guards, audit_log)


def _tenant(name: str, spec, guards: dict, path: str) -> Tenant:
    where = f"tenants.{name}"
    spec = _table(spec, where, path)
    _no_unknown(spec, TENANT_FIELDS, where + ".", path)
    keys = tuple(_keys(spec.get("keys"), where + ".keys", path))
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (0 < weight < math.inf):
        raise TenantsFileError(f"{path}: {where}.weight: expected a positive number, got {weight!r}")
    pinned = spec.get("service_class")
    try:
        service_class = parse_class(pinned) if pinned is not None else None
    except (ValueError, TypeError) as exc:
        raise TenantsFileError(f"{path}: {where}.service_class: {exc}") from None
    models = _strings(spec.get("models", [ALL_MODELS]), where + ".models", path)
    tenant_guards = _strings(spec.get("guards", []), where + ".guards", path)
    unknown = [g for g in tenant_guards if g not in guards]
    if unknown:
        raise TenantsFileError(f"{path}: {where}.guards: no guard named {unknown[0]!r} under [guards]")
    audit_text = spec.get("audit_text", False)
    if not isinstance(audit_text, bool):
        raise TenantsFileError(f"{path}: {where}.audit_text: expected true or false")
    return Tenant(name, keys, float(weight), service_class, frozenset(models), tuple(tenant_guards), audit_text,
                  _limits(spec.get("limits", {}), where + ".limits", path))


def _limits(spec, where: str, path: str) -> TenantLimits:
    spec = _table(spec, where, path)
    _no_unknown(spec, frozenset(LIMIT_FIELDS), where + ".", path)
    values = {}
    for name in LIMIT_FIELDS:
        value = spec.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TenantsFileError(f"{path}: {where}.{name}: expected a positive integer, got {value!r}")
        values[name] = value
    limits = TenantLimits(**values)
    if limits.default_max_tokens and limits.max_tokens and limits.default_max_tokens > limits.max_tokens:
        raise TenantsFileError(f"{path}: {where}.default_max_tokens: larger than max_tokens ({limits.max_tokens})")
    return limits


def _check_unique_keys(tenants: dict[str, Tenant], admin_keys: tuple[str, ...], path: str) -> None:
    owner: dict[str, str] = {key: "admin_keys" for key in admin_keys}
    for name, tenant in tenants.items():
        for key in tenant.keys:
            if key in owner:
                raise TenantsFileError(f"{path}: tenants.{name}.keys: a key is also listed under {owner[key]}")
            owner[key] = f"tenants.{name}.keys"


def _table(value, where: str, path: str) -> dict:
    if value is None:
        raise TenantsFileError(f"{path}: {where}: missing")
    if not isinstance(value, dict):
        raise TenantsFileError(f"{path}: {where}: expected a table, got {type(value).__name__}")
    return value


def _no_unknown(table: dict, known: frozenset[str], prefix: str, path: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise TenantsFileError(f"{path}: {prefix}{unknown[0]}: unknown field; expected one of "
                               f"{', '.join(sorted(known))}")


def _strings(value, where: str, path: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TenantsFileError(f"{path}: {where}: expected a list of non-empty strings")
    return value


def _keys(value, where: str, path: str, allow_empty: bool = False) -> list[str]:
    if value is None:
        raise TenantsFileError(f"{path}: {where}: missing (a list of API keys)")
    keys = _strings(value, where, path)
    if not keys and not allow_empty:
        raise TenantsFileError(f"{path}: {where}: at least one key is needed")
    if any(not k.strip() or k != k.strip() for k in keys):
        raise TenantsFileError(f"{path}: {where}: a key is empty or has surrounding spaces")
    if len(set(keys)) != len(keys):
        raise TenantsFileError(f"{path}: {where}: a key is listed twice")
    return keys
