"""Launch configs: the per-vendor tables in ``backends/`` and the one function that picks a config.

:func:`resolve` answers "which launch config for kernel K on this device, for this problem and
dtype". It looks, in order, at

1. the user autotune cache (``$LIGER_PORTABLE_CACHE_DIR`` or ``$XDG_CACHE_HOME/liger_portable``),
2. the tuned files shipped in ``autotune_cache/``,
3. the vendor table ``backends/<backend>.json``: the section of the device's arch, then the
   vendor's ``default`` section, then ``backends/base.json`` (sparse tables: see :mod:`._tables`).

With ``LIGER_PORTABLE_AUTOTUNE=1`` a miss in 1 and 2 is tuned once per process through the
kernel's registered hook and recorded in 1 before falling back to 3: the tuner
(:mod:`liger_portable.tuning.runtime`) installs itself as the miss handler (:func:`set_miss_handler`).
The answer is validated against the device's limits (threads per block, shared memory) and the
backend's option names; answers are memoized, so that a repeated call costs one dict lookup.

Table format (``backends/<backend>.json``, as :func:`._tables.expand` flattens it)::

    {
      "schema": 1,
      "backend": "cuda",
      "sections": {
        "default": {                      # required, used when no arch section matches
          "limits": {"warp_size": 32, "max_threads_per_block": 1024, "shared_mem_per_block": 101376},
          "measured": "how the values were obtained",
          "kernels": {
            "rms_norm_fwd": {
              "base": {"num_stages": 1},  # merged under every rule's config
              "rules": [                  # first rule whose "upto" bounds all hold wins
                {"upto": {"n_cols": 1024}, "config": {"num_warps": 4, ...}, "why": "..."},
                {"config": {...}, "why": "..."}        # the default section ends with a catch-all
              ],
              "search": {"space": {"num_warps": [4, 8, 16], ...}, "why": "..."}
            }
          }
        },
        "sm90": {"match": ["sm90*"], "limits": {...}, "measured": "...", "kernels": {...}}
      }
    }

A config holds ``num_warps``, optionally ``num_stages``, every ``tl.constexpr`` the kernel's
:class:`~liger_portable.specs.KernelSpec` declares, and options of this backend only.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from . import autotune_cache, _paths, _tables
from .hardware import ALL_BACKEND_OPTIONS, DeviceInfo, on_reset
# Table validation lives in _tables (below this module); re-exported here, where callers look.
from ._tables import LIMIT_FIELDS, SCHEMA, ConfigError, Limits, check_config, check_limits  # noqa: F401
from .specs import SPECS, KernelSpec
from ._warn import warn

_GPU_BACKENDS = ("cuda", "rocm", "xpu")
ENV_AUTOTUNE = "LIGER_PORTABLE_AUTOTUNE"  # "1": tune a cache miss once per process (see tuning.runtime)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch config: warps, stages, constexpr parameters and backend options."""

    num_warps: int
    num_stages: int | None
    params: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LaunchConfig":
        params = tuple(sorted((k, v) for k, v in d.items() if k[:1].isupper()))
        options = tuple(sorted((k, v) for k, v in d.items() if k in ALL_BACKEND_OPTIONS))
        return cls(int(d["num_warps"]), d.get("num_stages"), params, options)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            out["num_stages"] = self.num_stages
        out.update(self.params)
        out.update(self.options)
        return out

    def __getitem__(self, name: str) -> int:
        return dict(self.params)[name]

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.to_dict().items())


@dataclass(frozen=True)
class Resolved:
    """The answer of :func:`resolve`.

    Attributes:
        config: the validated launch config.
        source: where it came from, e.g. ``table cuda.json [sm90] rule 2``.
        launch: keyword arguments for ``kernel[grid](..., **launch)``: warps, stages, backend
            options and the constexpr parameters the kernel takes.
        meta: every parameter (host-side ones too) as a dict, for the launch code's arithmetic.
    """

    config: LaunchConfig
    source: str
    launch: dict[str, Any]
    meta: dict[str, int]


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Rule:
    upto: tuple[tuple[str, int], ...]
    config: dict[str, Any]
    source: str = ""  # set for a rule inherited from base.json (see _tables)

    def matches(self, problem: Mapping[str, int]) -> bool:
        return all(problem[k] <= v for k, v in self.upto)


@dataclass(frozen=True)
class KernelEntry:
    rules: tuple[Rule, ...]
    search: dict[str, list]


@dataclass(frozen=True)
class Section:
    name: str
    match: tuple[str, ...]
    limits: Limits
    measured: str
    kernels: dict[str, KernelEntry]


@dataclass(frozen=True)
class Table:
    backend: str
    path: Path
    sections: dict[str, Section]
    unsupported: tuple[tuple[tuple[str, ...], str], ...] = ()  # (arch patterns, why) the kernels cannot run on

    def unsupported_reason(self, arch: str) -> str | None:
        """Why the kernels cannot run on ``arch`` (the table's ``unsupported`` entry matching it), or None."""
        for patterns, why in self.unsupported:
            if any(fnmatch.fnmatchcase(arch, p) for p in patterns):
                return why
        return None

    def section_for(self, arch: str) -> Section:
        """The arch section for ``arch`` (exact name, then ``match`` patterns), else ``default``."""
        if arch in self.sections:
            return self.sections[arch]
        for s in self.sections.values():
            if any(fnmatch.fnmatchcase(arch, p) for p in s.match):
                return s
        return self.sections["default"]


def _need(d: dict, key: str, typ: type, where: str):
    if key not in d:
        raise ConfigError(f"{where}: missing field {key!r}")
    if not isinstance(d[key], typ):
        raise ConfigError(f"{where}: field {key!r} must be {typ.__name__}, got {type(d[key]).__name__}")
    return d[key]


def parse_table(data: Any, path: Path, backend: str) -> Table:
    """Validate a decoded table and build a :class:`Table`. Errors name file, kernel and field."""
    f = path.name
    data = _tables.expand(data, path, backend)  # base.json -> default -> arch sections, flattened
    if not isinstance(data, dict):
        raise ConfigError(f"{f}: top level must be an object")
    if data.get("schema") != SCHEMA:
        raise ConfigError(f"{f}: field 'schema' must be {SCHEMA}, got {data.get('schema')!r}")
    if data.get("backend") != backend:
        raise ConfigError(f"{f}: field 'backend' must be {backend!r}, got {data.get('backend')!r}")
    raw_sections = _need(data, "sections", dict, f)
    if "default" not in raw_sections:
        raise ConfigError(f"{f}: missing section 'default' (used when no arch section matches)")
    sections: dict[str, Section] = {}
    for sname, raw in raw_sections.items():
        sw = f"{f} [{sname}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{sw}: section must be an object")
        limits = check_limits(raw.get("limits"), sw)
        measured = _need(raw, "measured", str, sw)
        match = raw.get("match", [])
        if not isinstance(match, list) or not all(isinstance(m, str) and m for m in match):
            raise ConfigError(f"{sw}: field 'match' must be a list of arch patterns such as [\"sm9*\"]")
        match = tuple(match)
        kernels: dict[str, KernelEntry] = {}
        for kname, kraw in _need(raw, "kernels", dict, sw).items():
            kw = f"{sw} kernel {kname!r}"
            kw = kraw.get("_where", kw) if isinstance(kraw, dict) else kw  # inherited: names base.json
            spec = SPECS.get(kname)
            if spec is None:
                raise ConfigError(f"{kw}: unknown kernel; known kernels: {', '.join(SPECS)}")
            if not isinstance(kraw, dict):
                raise ConfigError(f"{kw}: entry must be an object with 'rules' (and 'search', 'base')")
            base = kraw.get("base", {})
            check_config(base, spec, backend, limits, f"{kw} base", partial=True)
            rules = []
            for i, rraw in enumerate(_need(kraw, "rules", list, kw)):
                rw = f"{kw} rule {i}"
                if not isinstance(rraw, dict):
                    raise ConfigError(f"{rw}: rule must be an object with 'config' and 'why'")
                rw = rraw.get("_where", rw)
                _need(rraw, "why", str, rw)
                upto = rraw.get("upto", {})
                if not isinstance(upto, dict):
                    raise ConfigError(f"{rw}: field 'upto' must be an object of problem-field bounds")
                for field_name, bound in upto.items():
                    if field_name not in spec.key:
                        raise ConfigError(
                            f"{rw}: field 'upto.{field_name}' is not a problem field of {kname} "
                            f"({', '.join(spec.key)})"
                        )
                    if isinstance(bound, bool) or not isinstance(bound, int):
                        raise ConfigError(f"{rw}: field 'upto.{field_name}' must be an integer")
                cfg = {**base, **_need(rraw, "config", dict, rw)}
                check_config(cfg, spec, backend, limits, rw)
                rules.append(Rule(tuple(sorted(upto.items())), cfg, rraw.get("_source", "")))
            if sname == "default" and (not rules or rules[-1].upto):
                raise ConfigError(f"{kw}: field 'rules' must end with a rule without 'upto' (catch-all)")
            search_raw = kraw.get("search")
            if sname == "default" and search_raw is None:
                raise ConfigError(f"{kw}: missing field 'search' (the tuner's search space)")
            search: dict[str, list] = {}
            if search_raw is not None:
                sw2 = search_raw.get("_where", f"{kw} search") if isinstance(search_raw, dict) else f"{kw} search"
                if not isinstance(search_raw, dict):
                    raise ConfigError(f"{sw2}: must be an object with 'space' and 'why'")
                _need(search_raw, "why", str, sw2)
                for name, values in _need(search_raw, "space", dict, sw2).items():
                    if not isinstance(values, list) or not values:
                        raise ConfigError(f"{sw2}: field {name!r} must be a non-empty list")
                    for v in values:
                        check_config({name: v}, spec, backend, limits, f"{sw2} value", partial=True)
                    search[name] = values
            kernels[kname] = KernelEntry(tuple(rules), search)
        sections[sname] = Section(sname, match, limits, measured, kernels)
    missing = [k for k in SPECS if k not in sections["default"].kernels]
    if missing:
        raise ConfigError(f"{f} [default]: no entry for kernel(s) {', '.join(missing)}")
    unsupported = []
    raw_unsupported = data.get("unsupported", [])
    if not isinstance(raw_unsupported, list):
        raise ConfigError(f"{f}: field 'unsupported' must be a list of {{\"match\": [arch patterns], \"why\": ...}}")
    for i, entry in enumerate(raw_unsupported):
        uw = f"{f} unsupported {i}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{uw}: must be an object with 'match' and 'why'")
        match = _need(entry, "match", list, uw)
        if not match or not all(isinstance(m, str) and m for m in match):
            raise ConfigError(f"{uw}: field 'match' must be a non-empty list of arch patterns such as [\"sm6*\"]")
        unsupported.append((tuple(match), _need(entry, "why", str, uw)))
    return Table(backend, path, sections, tuple(unsupported))


def unsupported_reason(device: DeviceInfo) -> str | None:
    """Why ``device`` cannot run the Triton kernels (its vendor table's ``unsupported`` entry), or None."""
    return load_table(device.backend).unsupported_reason(device.arch)


@functools.lru_cache(maxsize=None)
def load_table(backend: str, directory: str | None = None) -> Table:
    """Load and validate ``backends/<backend>.json`` (memoized)."""
    if backend not in _GPU_BACKENDS:
        raise ValueError(f"backend must be one of {_GPU_BACKENDS}, got {backend!r}")
    path = Path(directory) if directory else _paths.backends_dir()
    path = path / f"{backend}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: config table missing; the installation is incomplete "
            "(reinstall liger-portable)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config table: {e}") from None
    return parse_table(data, path, backend)


# --------------------------------------------------------------------------- resolution


def table_config(
    table: Table, arch: str, kernel: str, problem: Mapping[str, int]
) -> tuple[dict[str, Any], str]:
    """The table's config for ``problem`` and a description of the rule that gave it."""
    section = table.section_for(arch)
    for s in (section, table.sections["default"]):
        entry = s.kernels.get(kernel)
        if entry is None:
            continue
        for i, rule in enumerate(entry.rules):
            if rule.matches(problem):
                return rule.config, rule.source or f"table {table.path.name} [{s.name}] rule {i}"
    raise AssertionError("unreachable: default sections end with a catch-all rule")


def table_default(kernel: str, device: DeviceInfo, named: Mapping[str, int]) -> dict[str, Any]:
    """The table's config for ``named`` on ``device`` (fitted to its limits, as resolve does),
    whatever the caches hold: the tuner's baseline and the config of a prerequisite launch."""
    cfg, _ = table_config(load_table(device.backend), device.arch, kernel, dict(named))
    cfg = dict(cfg)
    spec, limits = SPECS[kernel], Limits.of(device)
    try:
        check_config(cfg, spec, device.backend, limits, "table default", arch=device.arch)
    except ConfigError:
        cfg = _fit_to_device(cfg, limits)
    return cfg


def search_space(table: Table, arch: str, kernel: str) -> dict[str, list]:
    """The tuner's search space for ``kernel`` on ``arch`` (arch section first, else default)."""
    section = table.section_for(arch)
    entry = section.kernels.get(kernel)
    if entry is None or not entry.search:
        entry = table.sections["default"].kernels[kernel]
    return entry.search


def search_configs(table: Table, arch: str, kernel: str, limits: Limits) -> Iterator[dict[str, Any]]:
    """Every point of the search space that is legal on ``limits``: dicts of the searched fields
    only; the caller merges them over a full config (the table default) before launching."""
    spec = SPECS[kernel]
    space = search_space(table, arch, kernel)
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        cfg = dict(zip(names, values))
        try:
            check_config(cfg, spec, table.backend, limits, "search", partial=True)
            yield cfg
        except ConfigError:
            continue


_memo: dict[tuple, Resolved] = {}
_memo_lock = threading.Lock()
_warned: set[str] = set()


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def autotune_enabled() -> bool:
    """``LIGER_PORTABLE_AUTOTUNE`` set to a true value (1, true, yes, on; any case). Another value
    than those and the false ones (0, false, no, off, empty) costs one warning and means off."""
    value = os.environ.get(ENV_AUTOTUNE, "").strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        _warn_once(f"liger_portable: {ENV_AUTOTUNE}={os.environ[ENV_AUTOTUNE]!r} is not a true or false value "
                   f"(1/true/yes/on or 0/false/no/off); autotuning stays off")
    return False


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warn(msg, RuntimeWarning)


def _clear_memo() -> None:
    with _memo_lock:
        _memo.clear()
    _warned.clear()
    load_table.cache_clear()
    autotune_cache.clear()


def _drop_resolved() -> None:
    # A new tuned entry was written: forget resolved configs so the next resolve sees it. No lock:
    # this may run inside resolve's locked section (runtime autotuning), and dict.clear is atomic.
    _memo.clear()


on_reset(_clear_memo)
autotune_cache.on_write(_drop_resolved)


def make_resolved(kernel: str, cfg: dict[str, Any], source: str = "explicit") -> Resolved:
    """A :class:`Resolved` for an explicit config (validated by the caller), as the tuner needs."""
    return _make(SPECS[kernel], cfg, source)


def _make(spec: KernelSpec, cfg: dict[str, Any], source: str) -> Resolved:
    lc = LaunchConfig.from_dict(cfg)
    kernel_params = {k: v for k, v in lc.params if not spec.params[k].host}
    launch = {**kernel_params, "num_warps": lc.num_warps, **dict(lc.options)}
    if lc.num_stages is not None:
        launch["num_stages"] = lc.num_stages
    return Resolved(lc, source, launch, dict(lc.params))


def _fit_to_device(cfg: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """Shrink ``num_warps`` until the config fits a device whose limits the table did not know."""
    cfg = dict(cfg)
    while cfg["num_warps"] > 1 and cfg["num_warps"] * limits.warp_size > limits.max_threads_per_block:
        cfg["num_warps"] //= 2
    return cfg


# Triton's largest block (``TRITON_MAX_TENSOR_NUMEL``): a tile beyond it does not compile.
MAX_TILE_ELEMENTS = 2**20


def check_cached(cfg: Any, spec: KernelSpec, device: DeviceInfo, named: Mapping[str, int], where: str) -> None:
    """Raise :class:`ConfigError` if a tuned ``cfg`` cannot be used for the problem ``named`` on
    ``device``: a field out of its range or the device's limits, or a tile larger than Triton
    compiles (each field can be legal alone and the tile too large: ``BLOCK_M`` x the column block)."""
    check_config(cfg, spec, device.backend, Limits.of(device), f"{where} kernel {spec.name!r}", arch=device.arch)
    if spec.tile_values is not None:
        tile = spec.tile_values(cfg, dict(named))
        if tile > MAX_TILE_ELEMENTS:
            raise ConfigError(f"{where} kernel {spec.name!r}: a tile of {tile} values for {dict(named)} is over "
                              f"Triton's {MAX_TILE_ELEMENTS}-element limit")


def _cached(spec: KernelSpec, device: DeviceInfo, named: dict, dtype: torch.dtype) -> Resolved | None:
    """The first legal tuned config in the caches (user, then shipped), or ``None``."""
    for cfg, where in autotune_cache.lookup(spec, device, named, dtype):
        try:
            check_cached(cfg, spec, device, named, where)
        except ConfigError as e:
            _warn_once(f"liger_portable: ignoring a cached config: {e}")
            continue
        return _make(spec, cfg, where)
    return None


def usable_entry(spec: KernelSpec, device: DeviceInfo, named: Mapping[str, int], dtype: torch.dtype) -> dict | None:
    """The user cache's entry for this problem (:func:`autotune_cache.lookup_entry`) if
    :func:`resolve` would use its config (legal on ``device``), else None: tuning and the warmup
    treat an unusable entry (an illegal or missing config, e.g. written by another version of the
    package) as a miss, which the next tuned result replaces. Times that are not numbers read as None."""
    entry = autotune_cache.lookup_entry(spec, device, named, dtype)
    if entry is None or not isinstance(entry.get("config"), dict):
        return None
    try:
        check_cached(entry["config"], spec, device, named, "user cache")
    except ConfigError:
        return None

    def number(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    return {**entry, "time_ms": number(entry.get("time_ms")), "default_ms": number(entry.get("default_ms"))}


# Called on a cache miss when LIGER_PORTABLE_AUTOTUNE=1 is set at that moment:
# handler(kernel, device, problem, dtype) -> True if the user cache now holds an entry. The tuner
# (liger_portable.tuning.runtime) installs itself here; this module never imports it.
_miss_handler: Callable[[str, DeviceInfo, tuple, torch.dtype], bool] | None = None


def set_miss_handler(fn: Callable[[str, DeviceInfo, tuple, torch.dtype], bool] | None) -> None:
    """Install ``fn`` as the cache-miss handler of :func:`resolve` (``None`` removes it)."""
    global _miss_handler
    _miss_handler = fn


def _resolve_uncached(kernel: str, device: DeviceInfo, problem: tuple, dtype: torch.dtype) -> Resolved:
    spec = SPECS[kernel]
    if len(problem) != len(spec.key):
        raise ValueError(
            f"resolve({kernel!r}): the problem must give {len(spec.key)} values, {', '.join(spec.key)}; "
            f"got {tuple(problem)!r}"
        )
    named = dict(zip(spec.key, problem))
    limits = Limits.of(device)
    hit = _cached(spec, device, named, dtype)
    if hit is not None:
        return hit
    if autotune_enabled() and _miss_handler is not None:
        if _miss_handler(kernel, device, problem, dtype):
            hit = _cached(spec, device, named, dtype)
            if hit is not None:
                return hit
    table = load_table(device.backend)
    cfg, where = table_config(table, device.arch, kernel, named)
    try:
        check_config(cfg, spec, device.backend, limits, f"{where} kernel {kernel!r}", arch=device.arch)
    except ConfigError as e:
        fitted = _fit_to_device(cfg, limits)
        check_config(fitted, spec, device.backend, limits, f"{where} kernel {kernel!r} (fitted)", arch=device.arch)
        _warn_once(
            f"liger_portable: {e}. Device {device.name} ({device.arch}) has smaller limits than the "
            f"{table.path.name} section used; using num_warps={fitted['num_warps']} instead"
        )
        cfg, where = fitted, where + " (fitted to device limits)"
    return _make(spec, cfg, where)


def resolve(kernel: str, device: DeviceInfo, problem: tuple, dtype: torch.dtype) -> Resolved:
    """The launch config for ``kernel`` on ``device`` for ``problem`` (values in the order of the
    kernel spec's ``key``) and ``dtype``. Memoized: a repeated call is one dict lookup.

    Raises:
        ConfigError: the table is malformed or missing (names file, kernel and field).
        ValueError: ``problem`` does not have one value per field of the spec's key.
    """
    memo_key = (kernel, device, problem, dtype)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    with _memo_lock:
        hit = _memo.get(memo_key)
        if hit is None:
            hit = _resolve_uncached(kernel, device, problem, dtype)
            _memo[memo_key] = hit
    return hit


def resolved() -> dict[tuple, Resolved]:
    """A copy of what :func:`resolve` returned so far in this process (since the last reset or new
    tuned entry): ``(kernel, device, problem, dtype) -> Resolved``. For checks that compare the
    configs of several processes."""
    return dict(_memo)  # no lock, as in _drop_resolved: the copy is atomic
