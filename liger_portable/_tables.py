"""Table inheritance: ``backends/base.json`` -> a vendor's ``default`` section -> an arch section.

:func:`expand` turns a sparse vendor table (``backends/<vendor>.json``) and the shared
``backends/base.json`` beside it into the flat form :func:`liger_portable.configs.parse_table`
validates: every section's ``kernels`` keyed by single kernel names, the ``default`` section
holding an entry for every kernel. Each inherited rule, search space and base field keeps the
name of the file that wrote it, for error messages and for the ``source`` that ``resolve`` shows.

base.json::

    {
      "schema": 1,
      "about": "...",
      "base": {"num_stages": 1},           # merged under every kernel's rules (optional)
      "kernels": {
        "rms_norm_fwd, fused_add_rms_norm_fwd, layer_norm_fwd": {   # one entry, three kernels
          "base": {...}, "rules": [...], "search": {"space": {...}, "why": "..."}
        },
        ...
      }
    }

No limits (they are hardware facts: each vendor section has its own) and no vendor launch option
(``maxnreg``, ``waves_per_eu``, ``grf_mode``, ...) anywhere in base.json: the values are
vendor-neutral, for 32-lane warps.

Lookup of kernel K on arch A: the arch section of A, then the vendor's ``default``, then base.json.

- A key of ``kernels`` may name several kernels separated by commas: they share the entry. A
  kernel may appear in one key per section.
- An entry lists only the fields that differ from the level it inherits from: ``rules``,
  ``search``, ``base``. ``rules`` replaces the inherited list as a whole (first matching rule wins
  within the list that is chosen); ``search`` replaces the inherited search space as a whole (its
  ``why`` explains the whole space); ``base`` merges per field, the more specific level winning.
- A section may hold a ``base`` too: merged under every entry of that section, over what the
  section inherits (rocm.json's default sets ``num_stages`` 2 this way).
- The vendor ``default`` section inherits base.json; after merging it must cover every kernel,
  each with a search space and rules that end with a catch-all (a rule without ``upto``). A rule
  list in base.json ends with a catch-all too.
- An arch section inherits the vendor default. Its ``base`` fields apply to its own rules; its
  rules need not end with a catch-all: sizes none of them covers use the default's rules unchanged
  (the arch section overrides the default for the sizes its rules cover). An entry without
  ``search`` uses the default's search space.
- An arch section with ``"inherits": "base"`` skips the vendor default and inherits base.json the
  way the default does (then, like the default, it must be complete): AMD RDNA is wave32, so
  base.json's 32-lane values fit it and the wave64 CDNA default does not.

Sources: a rule written in the vendor file reads ``table cuda.json [sm90] rule 2`` as before; a
rule inherited from base.json reads ``table base.json rule 2 (inherited by cuda.json [default])``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hardware import ALL_BACKEND_OPTIONS, ARCH_OPTION_VALUES, BACKEND_OPTIONS, OPTION_RULES, DeviceInfo
from .specs import SPECS, KernelSpec

SCHEMA = 1
LIMIT_FIELDS = ("warp_size", "max_threads_per_block", "shared_mem_per_block")


class ConfigError(ValueError):
    """A config table or cache entry is malformed; the message names file, kernel and field."""


@dataclass(frozen=True)
class Limits:
    warp_size: int
    max_threads_per_block: int
    shared_mem_per_block: int

    @classmethod
    def of(cls, device: DeviceInfo) -> "Limits":
        return cls(device.warp_size, device.max_threads_per_block, device.shared_mem_per_block)



# --------------------------------------------------------------------------- validation (of one config)


def check_config(
    cfg: Any, spec: KernelSpec, backend: str, limits: Limits, where: str, *, partial: bool = False,
    arch: str = "",
) -> None:
    """Raise :class:`ConfigError` if ``cfg`` is not a legal config of ``spec`` on ``limits`` (and on
    ``arch`` where given: some archs accept fewer option values)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: config must be an object, got {type(cfg).__name__}")
    for name, value in cfg.items():
        if name == "num_warps":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ConfigError(f"{where}: field 'num_warps' must be a power of two >= 1, got {value!r}")
            # the sub-group size the config sets (XPU), else the device's warp size
            warp = cfg.get("threads_per_warp", limits.warp_size)
            warp = warp if isinstance(warp, int) and not isinstance(warp, bool) else limits.warp_size
            threads = value * warp
            if threads > limits.max_threads_per_block:
                raise ConfigError(
                    f"{where}: field 'num_warps'={value} gives {threads} threads per block "
                    f"(warp size {warp}) over the limit of {limits.max_threads_per_block}; "
                    f"use num_warps <= {limits.max_threads_per_block // warp}"
                )
        elif name == "num_stages":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
                raise ConfigError(f"{where}: field 'num_stages' must be an integer in [1, 8], got {value!r}")
        elif name in spec.params:
            err = spec.params[name].check(value)
            if err:
                raise ConfigError(f"{where}: field {name!r} ({spec.params[name].doc}) {err}")
        elif name in ALL_BACKEND_OPTIONS:
            if name not in BACKEND_OPTIONS[backend]:
                owner = next(b for b, opts in BACKEND_OPTIONS.items() if name in opts)
                raise ConfigError(
                    f"{where}: field {name!r} is a {owner} launch option; the {backend} Triton backend "
                    f"raises KeyError for it at launch. Allowed options here: "
                    f"{sorted(BACKEND_OPTIONS[backend]) or 'none'}"
                )
            rule = OPTION_RULES[name]
            err = rule.check(value)
            narrower = ARCH_OPTION_VALUES.get(arch, {}).get(name)
            if err is None and narrower is not None and value not in narrower:
                err = f"must be one of {list(narrower)} on {arch}, got {value!r}"
            if err:
                raise ConfigError(f"{where}: field {name!r} ({rule.doc}) {err}")
        else:
            raise ConfigError(
                f"{where}: unknown field {name!r}; expected num_warps, num_stages, "
                f"{', '.join(spec.params)} or a {backend} option {sorted(BACKEND_OPTIONS[backend])}"
            )
    if partial:
        return
    missing = [n for n in ("num_warps", *spec.params) if n not in cfg]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    smem = spec.smem_bytes(cfg, cfg["num_warps"], 4)
    if smem > limits.shared_mem_per_block:
        raise ConfigError(
            f"{where}: needs about {smem} bytes of shared memory per block, over the limit of "
            f"{limits.shared_mem_per_block}"
        )


def check_limits(raw: Any, where: str) -> Limits:
    if not isinstance(raw, dict) or set(raw) != set(LIMIT_FIELDS):
        raise ConfigError(f"{where}: field 'limits' must have exactly {', '.join(LIMIT_FIELDS)}")
    for k in LIMIT_FIELDS:
        if isinstance(raw[k], bool) or not isinstance(raw[k], int) or raw[k] <= 0:
            raise ConfigError(f"{where}: field 'limits.{k}' must be a positive integer, got {raw[k]!r}")
    return Limits(**raw)



BASE_FILE = "base.json"
_BASE_FIELDS = ("schema", "about", "base", "kernels")


def _error(msg: str) -> Exception:
    return ConfigError(msg)


def load_base(directory: Path) -> tuple[Any, Path]:
    """The decoded ``base.json`` of ``directory`` and its path."""
    path = directory / BASE_FILE
    try:
        return json.loads(path.read_text()), path
    except FileNotFoundError:
        raise _error(
            f"{path}: base table missing; the vendor tables beside it inherit from it (reinstall liger-portable)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise _error(f"{path}: cannot read the base table: {e}") from None


def _split(kernels: dict, where: str) -> dict[str, Any]:
    """``kernels`` keyed by single kernel names: a key "a, b" gives both kernels the entry."""
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, entry in kernels.items():
        for name in (n.strip() for n in key.split(",")):
            if not name:
                raise _error(f"{where}: kernel key {key!r} has an empty name; separate kernel names with commas")
            if name in out:
                raise _error(f"{where} kernel {name!r}: listed twice, in {keys[name]!r} and {key!r}")
            out[name], keys[name] = copy.deepcopy(entry), key
    return out


def _reject_options(cfg: Any, where: str) -> None:
    for name in cfg if isinstance(cfg, dict) else ():
        if name in ALL_BACKEND_OPTIONS:
            owner = next(b for b, opts in BACKEND_OPTIONS.items() if name in opts)
            raise _error(
                f"{where}: field {name!r} is a {owner} launch option; {BASE_FILE} holds vendor-neutral "
                f"fields only (put it in {owner}.json)"
            )


def _base_entries(base: Any, bname: str) -> tuple[dict, dict[str, dict]]:
    """Check base.json's shape and that it names no vendor option; its file-level base and its
    entries by kernel. Values are checked where they are inherited, against each vendor's limits."""
    if not isinstance(base, dict):
        raise _error(f"{bname}: top level must be an object")
    if base.get("schema") != SCHEMA:
        raise _error(f"{bname}: field 'schema' must be {SCHEMA}, got {base.get('schema')!r}")
    for field in base:
        if field not in _BASE_FIELDS:
            why = " (limits are hardware facts: each vendor section has its own)" if field == "limits" else ""
            raise _error(f"{bname}: unknown field {field!r}{why}; expected {', '.join(_BASE_FIELDS)}")
    file_base = base.get("base", {})
    if not isinstance(file_base, dict):
        raise _error(f"{bname}: field 'base' must be an object of config fields")
    _reject_options(file_base, f"{bname} base")
    kernels = base.get("kernels")
    if not isinstance(kernels, dict):
        raise _error(f"{bname}: missing field 'kernels' (an object)")
    entries = _split(kernels, bname)
    for kname, entry in entries.items():
        kw = f"{bname} kernel {kname!r}"
        if kname not in SPECS:
            raise _error(f"{kw}: unknown kernel; known kernels: {', '.join(SPECS)}")
        if not isinstance(entry, dict):
            raise _error(f"{kw}: entry must be an object with 'rules' (and 'search', 'base')")
        _reject_options(entry.get("base"), f"{kw} base")
        for field in ("rules", "search", "base"):
            if field in entry and entry[field] is None:
                raise _error(f"{kw}: field {field!r} is null; give a value or leave the field out")
        rules = entry.get("rules")
        if rules is not None:
            if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
                raise _error(f"{kw}: field 'rules' must be a list of rule objects")
            for i, rule in enumerate(rules):
                _reject_options(rule.get("config"), f"{kw} rule {i}")
            if not rules or rules[-1].get("upto"):
                raise _error(f"{kw}: field 'rules' must end with a rule without 'upto' (catch-all)")
        search = entry.get("search")
        if search is not None:
            if not isinstance(search, dict) or not isinstance(search.get("space"), dict):
                raise _error(f"{kw} search: must be an object with 'space' and 'why'")
            _reject_options(search["space"], f"{kw} search")
    return file_base, entries


def _via(label: str, by: str) -> str:
    """``label`` (where a value is written) as inherited by section ``by``."""
    return f"{label.split(' (inherited by ')[0]} (inherited by {by})"


def expand(data: Any, path: Path, backend: str, base: tuple[Any, Path] | None = None) -> Any:
    """The vendor table ``data`` (decoded from ``path``) merged with base.json (``base``: decoded
    data and path; default: the ``base.json`` beside ``path``), in the flat form ``parse_table``
    reads. A table too malformed to merge is returned as it is, for ``parse_table`` to report."""
    base_data, base_path = base if base is not None else load_base(path.parent)
    bname, f = base_path.name, path.name
    file_base, base_entries = _base_entries(base_data, bname)
    if not isinstance(data, dict) or not isinstance(data.get("sections"), dict):
        return data
    raw_sections = data["sections"]
    order = ["default", *(s for s in raw_sections if s != "default")] if "default" in raw_sections else []
    out: dict[str, Any] = {}
    for sname in order:
        raw = raw_sections[sname]
        sw = f"{f} [{sname}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("kernels", {}), dict):
            out[sname] = raw
            continue
        inherits = raw.get("inherits", "default")
        if sname == "default" and "inherits" in raw:
            raise _error(f"{sw}: field 'inherits' is for arch sections (the default always inherits {bname})")
        if inherits not in ("default", "base"):
            raise _error(f"{sw}: field 'inherits' must be \"base\" (skip the default) or \"default\", got {inherits!r}")
        sec_base = raw.get("base", {})
        if not isinstance(sec_base, dict):
            raise _error(f"{sw}: field 'base' must be an object of config fields")
        limits = check_limits(raw.get("limits"), sw)
        own = _split(raw.get("kernels", {}), sw)
        root = sname == "default" or inherits == "base"
        if root:  # base.json's entries
            parents = base_entries
        elif isinstance(out.get("default"), dict) and isinstance(out["default"].get("kernels", {}), dict):
            parents = {k: e for k, e in out["default"].get("kernels", {}).items() if isinstance(e, dict)}  # merged
        else:
            parents = {}  # a malformed default: parse_table reports it
        kernels: dict[str, Any] = {}
        for kname in [*(parents if root else ()), *(k for k in own if not root or k not in parents)]:
            entry = own.get(kname)
            spec = SPECS.get(kname)
            if spec is None or (entry is not None and not isinstance(entry, dict)):
                kernels[kname] = entry  # parse_table names the problem
                continue
            kw = f"{sw} kernel {kname!r}"
            parent, entry = parents.get(kname, {}), entry or {}
            # base: merged per field, the more specific piece winning; each piece is checked against
            # this section's limits and named by the file and section that wrote it
            if root:
                inherited = [(file_base, f"{bname} base"), (parent.get("base", {}), f"{bname} kernel {kname!r} base")]
            else:  # the default's merged base, field by field
                origin = parent.get("_base_where", {})
                fallback = f"{f} [default] kernel {kname!r} base"
                inherited = [({k: v}, origin.get(k, fallback)) for k, v in parent.get("base", {}).items()]
            pieces = [(p, w, True) for p, w in inherited]
            pieces += [(sec_base, f"{sw} base (kernel {kname!r})", False), (entry.get("base", {}), f"{kw} base", False)]
            merged: dict[str, Any] = {}
            base_where: dict[str, str] = {}
            for piece, where, is_inherited in pieces:
                label = _via(where, sw) if is_inherited else where
                check_config(piece, spec, backend, limits, label, partial=True)
                merged.update(piece)
                base_where.update(dict.fromkeys(piece, where))
            new: dict[str, Any] = {"base": merged, "_base_where": base_where}
            if "base" in entry and "rules" not in entry and not root:
                raise _error(
                    f"{kw}: field 'base' without 'rules': an arch section's base applies to its own rules; "
                    f"sizes without a rule here use the {f} [default] rules unchanged"
                )
            if "rules" in entry:
                new["rules"] = entry["rules"]
            elif root and "rules" in parent:
                new["rules"] = [
                    {**r, "_where": _via(f"{bname} kernel {kname!r} rule {i}", sw),
                     "_source": f"table {bname} rule {i} (inherited by {sw})"}
                    for i, r in enumerate(parent["rules"])
                ]
            elif not root:
                new["rules"] = []  # every size falls through to the default's rules
            if "search" in entry:
                new["search"] = entry["search"]
            elif root and "search" in parent:
                new["search"] = {**parent["search"], "_where": _via(f"{bname} kernel {kname!r} search", sw)}
            if kname not in own:
                new["_where"] = _via(f"{bname} kernel {kname!r}", sw)
            if root:  # after merging: complete, as parse_table checks the default (again)
                where, rules = new.get("_where", kw), new.get("rules")
                if isinstance(rules, list) and (not rules or (isinstance(rules[-1], dict) and rules[-1].get("upto"))):
                    raise _error(f"{where}: field 'rules' must end with a rule without 'upto' (catch-all)")
                if "search" not in new:
                    raise _error(f"{where}: missing field 'search' (the tuner's search space)")
            kernels[kname] = new
        missing = [k for k in SPECS if k not in kernels]
        if root and missing:
            raise _error(f"{sw}: no entry for kernel(s) {', '.join(missing)} (in neither {f} nor {bname})")
        out[sname] = {k: v for k, v in raw.items() if k not in ("base", "inherits")} | {"kernels": kernels}
    return {**data, "sections": {s: out.get(s, raw_sections[s]) for s in raw_sections}}
