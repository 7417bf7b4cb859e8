"""Launching a ``@triton.jit`` kernel with a resolved config, with Triton's per-call work cached.

``kernel[grid](*args, **kwargs)`` binds and specialises every argument, builds a cache key string
and looks the compiled kernel up on every call, which is most of a launch's host time.
:class:`Launcher` does that work once per *specialisation* and then calls the compiled kernel's
launcher directly.

A specialisation is what Triton itself compiles a kernel for: the launch config (warps, stages,
backend options, constexpr values), the current device, and per argument its dtype and 16-byte
alignment (tensors), whether it equals 1, is a multiple of 16 and fits in 32 bits (integers), or
its type (floats, None). The key here holds all of these, so a cached kernel is only ever reused
for arguments Triton would have compiled the same kernel for; anything new takes Triton's own path
once, which compiles (or finds) the kernel and is then cached.

Where Triton's CUDA launch wrapper is known (see :func:`_direct`), its C launch function is called
with each tensor argument as its data pointer (read while keying the call): given a tensor, the C
function would call its ``data_ptr()`` and ask the driver to check the pointer, per argument.

The direct path is used only where it is known to hold: a Triton whose ``JITFunction.run`` ends in
``kernel.run(..., *bound_args.values())`` (checked at import), no launch hooks installed (profilers
such as proton install them), no pre-run hooks, and a compiled kernel returned by the launch (the
Triton interpreter returns none, so on the CPU every launch takes Triton's path).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .. import autotune_cache
from ..configs import Resolved, resolve
from ..hardware import DeviceInfo, PlatformError, launch_options, on_reset, platform

try:  # Triton >= 3.4: runtime knobs and the driver's current device and stream
    from triton import knobs as _knobs
    from triton.runtime.driver import driver  # the active backend's current device and stream
    from triton.runtime.jit import JITFunction as _JITFunction

    # True: this Triton's JITFunction.run ends in the launch this module makes directly.
    KNOWN_TRITON = "*bound_args.values()" in inspect.getsource(_JITFunction.run)
except Exception:  # noqa: BLE001 - an older or changed Triton: always take Triton's own path
    KNOWN_TRITON = False

# False: every launch takes Triton's own path (benchmarks compare the two; tests check both).
enabled: bool = True


def _active(hook: Any) -> bool:
    # Triton 3.5+ holds launch hooks in a HookChain that is never None; an empty one calls nothing.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def hooks_installed() -> bool:
    """True if launch hooks are installed (a profiler such as proton): launches then take Triton's path."""
    rt = _knobs.runtime
    return _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook)


def _feature(v: Any) -> Any:
    """What Triton specialises a runtime argument on: a tensor's dtype and 16-byte alignment, an
    integer's being 1, a multiple of 16 and within 32 bits, else the argument's type."""
    if type(v) is int:
        return (v == 1, v & 15 == 0, -0x80000000 <= v <= 0x7FFFFFFF)
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() & 15 == 0)
    return type(v)


# Triton's CUDA launcher (3.5, 3.6) is a Python wrapper that allocates the kernel's scratch buffers
# (none for a kernel that needs none) and then calls the C launch function with the cooperative-grid
# and PDL flags inserted. For a kernel that needs no scratch, the C function is called directly.
_WRAPPER_PARAMS = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_WRAPPER_TAIL = (
    "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
    "global_scratch, profile_scratch, *args)"
)
_known_wrapper: dict[type, bool] = {}


def _direct(run: Any) -> tuple | None:
    """(C launch function, cooperative-grid flag, PDL flag) of a compiled kernel's launcher whose
    Python wrapper is the known one and allocates nothing for this kernel; None otherwise (the
    wrapper is called)."""
    cls = type(run)
    known = _known_wrapper.get(cls)
    if known is None:
        try:
            call = cls.__call__
            known = list(inspect.signature(call).parameters) == _WRAPPER_PARAMS and " ".join(
                inspect.getsource(call).split()
            ).endswith(_WRAPPER_TAIL)
        except (TypeError, OSError, ValueError):
            known = False
        _known_wrapper[cls] = known
    if not known or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _on_device_of(t: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """A context in which ``t``'s GPU is the current device (``torch.cuda.device``, ``torch.xpu.device``);
    nothing for no tensor or a CPU one."""
    index = -1 if t is None else t.get_device()
    return getattr(torch, t.device.type).device(index) if index >= 0 else contextlib.nullcontext()


class Launcher:
    """Launch one ``@triton.jit`` function: ``launcher(grid, args, consts, launch)``.

    Args of a call:
        grid: the launch grid, 1 to 3 ints.
        args: the kernel's leading arguments, in order (tensors, ints, floats).
        consts: the remaining arguments by name (constexpr values, and optional arguments placed
            after the constexprs in the signature); arguments left out take their defaults.
        launch: ``num_warps``, ``num_stages`` and backend options (a resolved config's ``launch``
            minus its constexprs, which go in ``consts``).
    """

    __slots__ = ("fn", "_names", "_defaults", "_constexpr", "_keyers", "_cache")

    def __init__(self, fn: Any):
        self.fn = fn
        params = getattr(fn, "params", None)
        if params is None:  # the interpreter's function: no cache is ever filled
            self._names = ()
            self._defaults = ()
            self._constexpr = ()
        else:
            self._names = tuple(p.name for p in params)
            self._defaults = tuple(
                None if p.default is inspect.Parameter.empty else p.default for p in params
            )
            self._constexpr = tuple(bool(p.is_constexpr) for p in params)
        # per count of leading arguments: the generated key function (see _keyer)
        self._keyers: dict[int, Callable] = {}
        self._cache: dict[tuple, tuple] = {}

    def _keyer(self, n: int) -> Callable:
        """The key function of calls with ``n`` leading arguments, generated once (as Triton generates
        its binder): ``keyer(launch, device, args, consts) -> (key, values, pointers)``, ``values``
        being every argument of the kernel in order (the trailing ones from ``consts`` or their
        defaults) and ``pointers`` the same with each tensor replaced by its data pointer. Each runtime
        argument is keyed inline by its class: a tensor (or parameter) by dtype and 16-byte alignment,
        an int by being 1, a multiple of 16 and within 32 bits, a tensor subclass by :func:`_feature`,
        anything else (a float, None, a bool) by its type; a constexpr by its value."""
        keyer = self._keyers.get(n)
        if keyer is not None:
            return keyer
        env = {"T": torch.Tensor, "P": torch.nn.Parameter, "F": _feature}
        lines, keys, ptrs = [], [], []
        for i, (name, is_const) in enumerate(zip(self._names, self._constexpr)):
            v = f"v{i}"
            if i >= n:
                env[f"d{i}"] = self._defaults[i]
                lines.append(f"    {v} = consts.get({name!r}, d{i})")
            if is_const:
                keys.append(v)
                ptrs.append(v)
                continue
            lines += [
                f"    t = type({v})",
                "    if t is T or t is P:",
                f"        p{i} = {v}.data_ptr()",
                f"        k{i} = ({v}.dtype, p{i} & 15 == 0)",
                "    elif t is int:",
                f"        p{i}, k{i} = {v}, ({v} == 1, {v} & 15 == 0, -0x80000000 <= {v} <= 0x7FFFFFFF)",
                "    else:",
                f"        p{i}, k{i} = {v}, F({v}) if isinstance({v}, T) else t",
            ]
            keys.append(f"k{i}")
            ptrs.append(f"p{i}")
        names = [f"v{i}" for i in range(len(self._names))]
        src = "def keyer(launch, device, args, consts):\n"
        src += f"    {', '.join(names[:n])}, = args\n" if n else ""
        src += "\n".join(lines) + ("\n" if lines else "")
        src += f"    return (id(launch), device, {', '.join(keys)}), ({', '.join(names)},), ({', '.join(ptrs)},)\n"
        exec(compile(src, f"<launch key of {getattr(self.fn, '__name__', 'kernel')}>", "exec"), env)
        keyer = self._keyers[n] = env["keyer"]
        return keyer

    def __call__(self, grid: tuple, args: tuple, consts: dict[str, Any], launch: dict[str, Any]) -> None:
        if _captured is not None:  # recording launches instead of making them (see capture)
            _captured.append(Captured(self.fn, grid, args, dict(consts), dict(launch)))
            return
        if _op_bodies.depth and _traced(args):  # torch.compile traces a kernel_op
            n = len(args)
            rest = (consts.get(name, d) for name, d in zip(self._names[n:], self._defaults[n:]))
            torch.library.wrap_triton(self.fn)[grid](*args, *rest, **launch)
            return
        if not (enabled and KNOWN_TRITON and self._names):
            with _on_device_of(_first_tensor(args)):
                self.fn[grid](*args, **consts, **launch)
            return
        # Triton launches on the current device (its stream, its compile target). Tensors on another
        # GPU of the process (a model split over GPUs, device_map="auto") are launched with their
        # own device made current for the call.
        device = driver.active.get_current_device()
        first = _first_tensor(args)
        if first is not None and first.get_device() not in (device, -1):
            with _on_device_of(first):
                self(grid, args, consts, launch)
            return
        keyer = self._keyers.get(len(args)) or self._keyer(len(args))
        key, values, pointers = keyer(launch, device, args, consts)
        hit = self._cache.get(key)
        if hit is None or hit[0] is not launch or hooks_installed():
            self._slow(key, grid, args, consts, launch)
            return
        _, run, function, packed, device, direct = hit
        g = grid + (1, 1)
        stream = driver.active.get_current_stream(device)
        if direct is None:
            run(g[0], g[1], g[2], stream, function, packed, None, None, None, *values)
        else:
            # The C launch function takes a pointer argument as an int as it is; a tensor it would
            # ask for its data_ptr() and have the driver check (cuPointerGetAttribute), per argument
            # and launch. The tensors here are on the launch's GPU: device_info() admits no others.
            c_launch, cooperative, pdl = direct
            c_launch(g[0], g[1], g[2], stream, function, cooperative, pdl, None, None, packed, None, None, None, *pointers)

    def _slow(self, key: tuple, grid: tuple, args: tuple, consts: dict, launch: dict) -> None:
        """Triton's own launch; the compiled kernel it returns is kept for this specialisation."""
        compiled = self.fn[grid](*args, **consts, **launch)
        if compiled is None or self.fn.pre_run_hooks or hooks_installed():
            return
        try:
            entry = (launch, compiled.run, compiled.function, compiled.packed_metadata, key[1], _direct(compiled.run))
        except AttributeError:  # not a compiled kernel of the kind this path knows
            return
        # ``launch`` is held by the entry, so its id (part of the key) cannot be reused meanwhile.
        self._cache[key] = entry


# --------------------------------------------------------------------------- autograd apply
# ``Function.apply`` is a Python classmethod around the C++ apply: per call it rebuilds a closure,
# looks up setup_context, asks whether functorch transforms are active and unwraps dead functorch
# wrappers from every argument, about a third of an empty Function's forward cost on the host.
# :func:`eager_apply` does the same work for the arguments it knows are tensors and otherwise calls
# the C++ apply directly; under torch.compile (whose tracer knows ``Function.apply``) and inside
# functorch transforms it calls ``Function.apply`` itself.

try:
    from torch._C import _are_functorch_transforms_active as _transforms_active
    from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead
except ImportError:  # pragma: no cover - a torch without them: always the full path
    _transforms_active = None


def eager_apply(cls: type, tensors: int) -> Callable[..., Any]:
    """``cls.apply`` (``cls`` an ``autograd.Function`` without ``setup_context``) for calls whose
    first ``tensors`` arguments are tensors or None and whose others are not tensors; the same
    result as ``cls.apply`` with less host time per eager call."""
    full = cls.apply
    if _transforms_active is None or getattr(cls, "setup_context", None) is not torch.autograd.Function.setup_context:
        return full
    base = super(torch.autograd.Function, cls).apply
    is_compiling = torch.compiler.is_compiling

    def apply(*args):
        if is_compiling() or _transforms_active():
            return full(*args)
        return base(*[a if a is None else _unwrap_if_dead(a) for a in args[:tensors]], *args[tensors:])

    apply.__doc__ = f"{cls.__name__}.apply for eager calls (see eager_apply)"
    return apply


# --------------------------------------------------------------------------- torch.compile
# Under torch.compile a family's autograd op calls its launches through a torch.library operator.
# On CUDA that operator is a ``triton_op``: the compiler traces its body once (fake tensors), the
# launches inside become ``wrap_triton`` calls, and Inductor launches the kernels from its compiled
# code with the config resolved while tracing, so a compiled step pays no Python per call. An
# opaque ``custom_op`` instead runs the body (checks, lookups, launches) on every call. Inductor's
# launch of a user kernel takes num_warps and num_stages only, not the ROCm and XPU tables' backend
# options (waves_per_eu, grf_mode, ...): there the operator stays a custom_op.

class _Depth(threading.local):
    depth = 0  # kernel_op bodies running on this thread


_op_bodies = _Depth()
_REAL = (torch.Tensor, torch.nn.Parameter)


try:  # torch >= 2.6 (triton_op); older torch registers custom ops only (inductor_launches)
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:  # pragma: no cover
    is_wrap_triton_enabled = None


def _traced(args: tuple) -> bool:
    """True if the launch's tensors are torch.compile's stand-ins (fake or functional tensors) and
    ``wrap_triton`` records launches (it does not while the operator runs eagerly)."""
    return is_wrap_triton_enabled() and any(isinstance(a, torch.Tensor) and type(a) not in _REAL for a in args)


def inductor_launches() -> bool:
    """True if kernel ops are ``triton_op``s here: an NVIDIA backend and a torch that has them."""
    try:
        backend = platform().backend
    except PlatformError:
        return False
    return backend == "cuda" and is_wrap_triton_enabled is not None and hasattr(torch.library, "triton_op")


_kernel_ops: dict[str, tuple[Callable, Callable]] = {}


def kernel_ops() -> dict[str, tuple[Callable, Callable]]:
    """Every operator :func:`kernel_op` registered: name -> (body, fake). The tests run each body
    on fake tensors (as torch.compile traces a triton_op) and compare its outputs with the fake's."""
    return dict(_kernel_ops)


def kernel_op(name: str, *, fake: Callable) -> Callable[[Callable], Any]:
    """Decorator: ``fn`` (tensors in, new tensors out, launches through :class:`Launcher`) as the
    torch.library operator ``name`` that a family's autograd op calls under torch.compile; ``fake``
    gives the outputs' shapes for the custom_op form (a triton_op traces ``fn`` itself)."""

    def register(fn: Callable) -> Any:
        _kernel_ops[name] = (fn, fake)
        if not inductor_launches():
            op = torch.library.custom_op(name, mutates_args=())(fn)
            op.register_fake(fake)
            return op
        depth = _op_bodies

        def body(*args, **kwargs):
            depth.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth.depth -= 1

        # The schema is inferred from the signature (followed through __wrapped__) with the string
        # annotations evaluated in the function's globals: give ``body`` the family module's.
        body = types.FunctionType(body.__code__, fn.__globals__, fn.__name__, None, body.__closure__)
        functools.update_wrapper(body, fn)
        return torch.library.triton_op(name, body, mutates_args=())

    return register


# --------------------------------------------------------------------------- capture
# The vendor compile matrix runs a family's own launch code on meta tensors and compiles what it
# would launch: the launch signature is read from the launch, never written a second time.


@dataclass(frozen=True)
class Captured:
    """One launch a :class:`Launcher` was asked to make under :func:`capture`."""

    fn: Any
    grid: tuple
    args: tuple
    kwargs: dict
    options: dict


_captured: list[Captured] | None = None


@contextlib.contextmanager
def capture() -> Iterator[list[Captured]]:
    """Record the launches made inside the block instead of making them (nothing runs on a device:
    use it with meta tensors). Yields the list the launches are appended to."""
    global _captured
    previous, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = previous


# --------------------------------------------------------------------------- launch plans
# A launch plan is what a kernel family's launch code derives from a resolved config and a problem
# (grid, constexpr values, launch options). It is built once per (kernel, device, problem, dtype)
# and memoized here, so an eager call costs one dictionary lookup before its launch. The memo is
# dropped with the resolved configs (platform reset, a new tuned entry).

_plans: dict[tuple, Any] = {}


def _drop_plans() -> None:
    _plans.clear()


on_reset(_drop_plans)
autotune_cache.on_write(_drop_plans)


def split_launch(cfg: Resolved) -> tuple[dict[str, Any], dict[str, Any]]:
    """A resolved config's launch keywords as (constexpr values, launch options), the backend's
    options spelled as the installed Triton wants them (:func:`~liger_portable.hardware.launch_options`)."""
    consts = {k: v for k, v in cfg.launch.items() if k[:1].isupper()}
    opts = {k: v for k, v in cfg.launch.items() if not k[:1].isupper()}
    p = platform()
    return consts, launch_options(p.backend, opts, p.triton_version)


def plan(kernel: str, dev: DeviceInfo, problem: tuple, dtype: torch.dtype, build: Callable, config: Resolved | None = None):
    """``build(cfg, dev, *problem)`` for the config :func:`resolve` picks, or for an explicit
    ``config`` (the tuner, benchmarks); memoized either way."""
    try:
        hash(problem)
    except TypeError:
        # Sizes torch.compile traces as symbols: a config is chosen for the sizes of this call
        # (int() makes the compiled graph specialise on them).
        problem = tuple(int(v) for v in problem)
    if config is not None:
        # Keyed by the config object, held by the entry (its id cannot be reused meanwhile): the
        # tuner launches one config many times while timing it.
        key = (kernel, dev, problem, dtype, id(config))
        hit = _plans.get(key)
        if hit is None or hit[0] is not config:
            hit = _plans[key] = (config, build(config, dev, *problem))
        return hit[1]
    key = (kernel, dev, problem, dtype)
    hit = _plans.get(key)
    if hit is None:
        hit = _plans[key] = build(resolve(kernel, dev, problem, dtype), dev, *problem)
    return hit


def supported() -> bool:
    """True if launches skip Triton's per-call binding (this Triton's launch path is the known one)."""
    return KNOWN_TRITON and enabled


__all__ = ["Captured", "Launcher", "capture", "eager_apply", "enabled", "kernel_op", "kernel_ops", "plan", "split_launch", "supported"]
