"""Declarations of reward-model services: what to load, how big it is, how to batch it.

A service is declared by a :class:`ServiceSpec`, in Python, in a TOML file
(:func:`load_service_specs`) or on a worker's command line
(:func:`parse_service_option`).  The loader is a ``"module:callable"`` string
(or a callable) that returns a *model object*:

* ``score(inputs: list) -> list`` (required): one result per input, in order;
* ``to(device: str)`` (optional): move the weights, e.g. ``"cuda:0"`` / ``"cpu"``;
* ``memory_mb() -> int|float`` (optional): device memory the model needs.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from ..handlers import resolve

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["ServiceSpec", "ServiceSpecError", "load_service_specs", "parse_service_option", "resolve_loader",
           "specs_from_cli"]

DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_WAIT_MS = 5.0
_SPEC_KEYS = ("name", "loader", "memory_mb", "max_batch", "max_wait_ms", "whole_device", "kwargs")


class ServiceSpecError(ConfigError):
    """A service declaration that cannot be used."""


@dataclass(slots=True, frozen=True)
class ServiceSpec:
    """One named reward-model service.

    ``memory_mb``: device memory the service occupies while resident.  When
    None, the model's own ``memory_mb()`` is asked after its first load (a
    service whose size is known neither way is refused at load time).
    ``max_batch``: most inputs scored in one ``score`` call (an action with
    more inputs than that is scored alone in one call).  ``max_wait_ms``: how
    long the first waiting request may wait for more to fill the batch.
    ``whole_device``: the service is placed alone on a device and every
    other service there is evicted first (a model whose activations need the
    card's whole memory).  ``kwargs``: passed to the loader.
    """

    name: str
    loader: str | Callable[..., Any]
    memory_mb: float | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    kwargs: dict = field(default_factory=dict)
    whole_device: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 128:
            raise ServiceSpecError(f"service name must be a non-empty string of at most 128 characters, got {self.name!r}")
        if isinstance(self.loader, str):
            if ":" not in self.loader or self.loader.startswith(":") or self.loader.endswith(":"):
                raise ServiceSpecError(f"service {self.name}: loader must be 'module:callable', got {self.loader!r}")
        elif not callable(self.loader):
            raise ServiceSpecError(f"service {self.name}: loader must be 'module:callable' or a callable")
        if self.memory_mb is not None and (_bad_number(self.memory_mb) or self.memory_mb < 0):
            raise ServiceSpecError(f"service {self.name}: memory_mb must be a finite non-negative number")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or self.max_batch < 1:
            raise ServiceSpecError(f"service {self.name}: max_batch must be a positive integer")
        if _bad_number(self.max_wait_ms) or self.max_wait_ms < 0:
            raise ServiceSpecError(f"service {self.name}: max_wait_ms must be a finite non-negative number")
        if not isinstance(self.whole_device, bool):
            raise ServiceSpecError(f"service {self.name}: whole_device must be true or false")
        if not isinstance(self.kwargs, dict):
            raise ServiceSpecError(f"service {self.name}: kwargs must be a table")

    def load(self) -> Any:
        """Call the loader; the result is the model object kept in host RAM."""
        model = resolve_loader(self.loader)(**self.kwargs)
        if not callable(getattr(model, "score", None)):
            raise ServiceSpecError(f"service {self.name}: loader returned {type(model).__name__}, which has no score()")
        return model


def _bad_number(v: Any) -> bool:
    return not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)


def resolve_loader(loader: str | Callable[..., Any]) -> Callable[..., Any]:
    """Import ``"package.module:callable"`` (dots after the colon walk attributes)."""
    if callable(loader):
        return loader
    try:
        return resolve(loader)
    except TypeError as e:
        raise ServiceSpecError(f"loader {loader!r} is not callable") from e


def load_service_specs(path: str | Path) -> list[ServiceSpec]:
    """Read services from a TOML file (format in docs/services.md).

    ``[defaults]`` (optional) gives max_batch / max_wait_ms / memory_mb for
    every service; each ``[[service]]`` table declares one service, with its
    loader keyword arguments in ``[service.kwargs]``.
    """
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ServiceSpecError(f"{path}: {e}") from None
    except OSError as e:
        raise ServiceSpecError(f"services file {path}: {e.strerror or e}") from None
    return specs_from_mapping(doc, source=str(path))


def specs_from_mapping(doc: dict, source: str = "<services>") -> list[ServiceSpec]:
    unknown = doc.keys() - {"service", "defaults"}
    if unknown:
        raise ServiceSpecError(f"{source}: unknown top-level keys {sorted(unknown)} (expected [[service]] and [defaults])")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ServiceSpecError(f"{source}: [defaults] must be a table")
    bad = defaults.keys() - {"memory_mb", "max_batch", "max_wait_ms"}
    if bad:
        raise ServiceSpecError(f"{source}: unknown keys in [defaults]: {sorted(bad)}")
    try:
        ServiceSpec(name="defaults", loader="m:f", **defaults)
    except ServiceSpecError as e:
        raise ServiceSpecError(f"{source}: [defaults]: {str(e).split(': ', 1)[-1]}") from None
    services = doc.get("service", [])
    if not isinstance(services, list):
        raise ServiceSpecError(f"{source}: 'service' must be an array of tables ([[service]])")
    specs: list[ServiceSpec] = []
    for i, table in enumerate(services):
        where = f"{source}: service #{i + 1}"
        if not isinstance(table, dict):
            raise ServiceSpecError(f"{where}: must be a table ([[service]])")
        bad = table.keys() - set(_SPEC_KEYS)
        if bad:
            raise ServiceSpecError(f"{where}: unknown keys {sorted(bad)}")
        if "name" not in table or "loader" not in table:
            raise ServiceSpecError(f"{where}: 'name' and 'loader' are required")
        try:
            specs.append(ServiceSpec(**{**defaults, **table}))
        except (ServiceSpecError, TypeError) as e:
            raise ServiceSpecError(f"{where}: {e}") from None
    _check_unique(specs, source)
    return specs


def _check_unique(specs: list[ServiceSpec], source: str) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ServiceSpecError(f"{source}: service {s.name!r} declared twice")
        seen.add(s.name)


def parse_service_option(text: str) -> ServiceSpec:
    """Parse a worker CLI ``--service`` value.

    ``name=module:callable[,key=value...]``: ``memory_mb``, ``max_batch``,
    ``max_wait_ms`` and ``whole_device`` set the spec; any other key is a loader keyword argument.
    Values are read as int, float, true/false, or else kept as strings.
    """
    head, *rest = text.split(",")
    name, sep, loader = head.partition("=")
    if not sep or not name or not loader:
        raise ServiceSpecError(f"--service {text!r}: expected name=module:callable[,key=value...]")
    fields: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for item in rest:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ServiceSpecError(f"--service {text!r}: {item!r} is not key=value")
        value = _scalar(raw)
        if key in ("memory_mb", "max_batch", "max_wait_ms", "whole_device"):
            fields[key] = value
        else:
            kwargs[key] = value
    return ServiceSpec(name=name.strip(), loader=loader.strip(), kwargs=kwargs, **fields)


def _scalar(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def specs_from_cli(services_file: str | Path | None, service_options: list[str] | None) -> list[ServiceSpec]:
    """The services of a worker started with ``--services FILE`` and/or repeated ``--service ...``."""
    specs = load_service_specs(services_file) if services_file else []
    specs += [parse_service_option(opt) for opt in service_options or ()]
    _check_unique(specs, "worker options")
    return specs
