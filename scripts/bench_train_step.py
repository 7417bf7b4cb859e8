"""One training step of a Hugging Face model, end to end: plain HF, patched by liger-kernel, patched by us.

The model is built from a config (no download) with the dimensions of a real checkpoint, bf16
weights, ``attn_implementation="sdpa"``, fused AdamW, and trains on one fixed batch of seeded random
token ids (labels = ids, so the loss falls as the model memorises it). Each variant runs in its own
subprocess of this script: peak memory starts from nothing, and liger-kernel's patches of module
globals (``modeling_llama.apply_rotary_pos_emb``, ...) cannot leak into the other variants. Every
variant builds the same initial weights (same seed, same device; checked by a fingerprint) and sees
the same batch, so the per-step losses are comparable: the first ``--loss-steps`` are compared with
HF's (max |diff|). Throughput is tokens per step over the median step time after ``--warmup`` steps
(each step timed between device synchronisations); peak memory is ``max_memory_allocated`` from
after the model is built to the end (weights, gradients, AdamW state and activations).

    python scripts/bench_train_step.py                      # llama (Llama-3.2-1B dims), 3 variants
    python scripts/bench_train_step.py --family qwen2       # Qwen2.5-1.5B dims; gemma2: Gemma-2-2B dims
    python scripts/bench_train_step.py --tiny               # the whole flow on the CPU in seconds
    python scripts/bench_train_step.py --family demo --profile   # the README demo's model; kernel times
    python scripts/bench_train_step.py --compile --repeats 3    # each variant under model.compile(), 3 rounds
    python scripts/bench_train_step.py --family llama-150m --repeats 5   # a ~150M model: host-bound steps

``--variants liger-portable-kernels`` is ours with every kernel of ours under torch.compile too
(``LIGER_PORTABLE_UNDER_COMPILE=kernels``; by default the compiler gets the norms, GLU and RoPE).
``--compile [MODE]`` compiles each variant's model after patching (``model.compile(mode=MODE)``;
``default``, ``reduce-overhead`` with CUDA graphs, or ``max-autotune-no-cudagraphs``); the warm-up
steps absorb the compilation. ``--compile-scope layers`` compiles each decoder layer instead of the whole model (torchtitan's way):
the attention mask, embedding, final norm and loss then run eagerly. ``--repeats N`` runs the variants N times, interleaved (hf, liger-kernel,
liger-portable, hf, ...), each run in a fresh subprocess, and reports the median tokens/s with the
spread of the runs (a host-bound step varies from run to run).

liger-kernel is taken from the environment (``BENCH_TIMEOUT=480 bash scripts/gpu_session.sh train_step``
installs the wheels in ``.whl/``); a variant that cannot be imported (``unavailable``) or breaks
(``failed``: out of memory, a kernel error) is reported in the table, and the others still run.
Goal (H200, llama, batch 4 x 4096): liger-portable >= 68k tokens/s at <= 25 GiB peak, the loss curve
matching HF's.
About 1 minute per variant on an H200 with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchlib import environment, markdown_table, record, require_destination, save_records
from liger_portable.demo import SIZES as DEMO_SIZES

VARIANTS = ("hf", "liger-kernel", "liger-portable", "liger-portable-kernels")
DEFAULT_VARIANTS = VARIANTS[:3]
# Per family: config and model classes of transformers, the checkpoint whose dimensions are used,
# the attention implementation (transformers refuses sdpa for Gemma-2, whose attention logits are
# soft-capped, so it runs eager, which keeps (batch, heads, seq, seq) scores per layer: hence its
# default batch of 1), the default batch, and the config fields.
FAMILIES = {
    "llama": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "ref": "Llama-3.2-1B", "attn": "sdpa",
              "batch": 4, "dims": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=131072)},
    "qwen2": {"config": "Qwen2Config", "model": "Qwen2ForCausalLM", "ref": "Qwen2.5-1.5B", "attn": "sdpa",
              "batch": 4, "dims": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=32768)},
    "gemma2": {"config": "Gemma2Config", "model": "Gemma2ForCausalLM", "ref": "Gemma-2-2B", "attn": "eager",
               "batch": 1, "dims": dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=8192, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh")},
    # A ~150M-parameter Llama-style model (GPT-2-small-like widths, Llama-2's vocabulary): its steps
    # are short, and the host's cost per kernel call decides much of their time.
    "llama-150m": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "ref": "Llama ~150M", "attn": "sdpa",
                   "batch": 8, "seq": 1024, "dims": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, vocab_size=32000, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=1024)},
    # The README demo's models (liger_portable.demo SIZES): "demo" on GPUs with 48 GiB or more,
    # "demo-small" below; the demo itself uses foreach AdamW, this bench fused AdamW.
    **{name: {"config": "LlamaConfig", "model": "LlamaForCausalLM", "ref": f"liger-portable {name}", "attn": "sdpa",
              "batch": DEMO_SIZES[key]["batch"], "seq": DEMO_SIZES[key]["seq"],
              "dims": {**DEMO_SIZES[key]["model"], "max_position_embeddings": DEMO_SIZES[key]["seq"]}}
       for name, key in (("demo", "gpu"), ("demo-small", "gpu-small"))},
}
# --tiny: the same family with toy sizes (the family's other fields, softcaps etc., are kept).
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256)
GOAL = {"llama": {"tokens_per_s": 68_000, "peak_gib": 25.0}}  # for liger-portable
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                    help="liger-portable-kernels: ours with every kernel of ours under torch.compile too "
                         "(UNDER_COMPILE = 'kernels'; the default leaves the norms, GLU and RoPE to Inductor)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4, gemma2 1; --tiny 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --tiny 64)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --tiny 3)")
    ap.add_argument("--loss-steps", type=int, default=10, help="steps of the loss curve compared with HF's")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights (default bfloat16; --tiny float32)")
    ap.add_argument("--device", default=None, help="default cuda if available, else cpu")
    ap.add_argument("--tiny", action="store_true", help="toy config on the CPU: checks the plumbing, measures nothing")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, profile 2 more and print each variant's device time by kernel")
    ap.add_argument("--variant-timeout", type=float, default=300, help="seconds before a variant's subprocess is killed")
    ap.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, default=None,
                    help="model.compile(mode=...) after patching (no value: the default mode)")
    ap.add_argument("--compile-scope", choices=("model", "layers"), default="model",
                    help="with --compile: the whole model (model.compile()) or each decoder layer "
                         "(layer.compile(), as torchtitan compiles; embedding, final norm and loss stay eager)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of all variants (median and spread)")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="torch.backends.cuda.enable_cudnn_sdp(False) in every variant (under model.compile() "
                         "SDPA ran its cuDNN kernels on the H200, slower there than the flash kernels eager runs)")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.variants = list(dict.fromkeys(args.variants))  # each once, in the order given
    fam = FAMILIES[args.family]
    for name, full, small in (("batch", fam["batch"], 2), ("seq", fam.get("seq", 4096), 64), ("warmup", 3, 1), ("steps", 20, 3)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--steps and --repeats must be >= 1 and --warmup >= 0")
    small = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("batch", "seq", "loss_steps")
             if getattr(args, name) < 1]
    if small:
        ap.error(f"--batch, --seq and --loss-steps must be >= 1, got {', '.join(small)}")
    try:
        torch.device(args.device)
    except (RuntimeError, ValueError):
        ap.error(f"--device {args.device!r} is not a torch device (e.g. cuda, cuda:1, cpu)")
    if not tiny and not args.worker:  # a CPU run's records go to $OUT only: say so before training
        require_destination(ap.prog, _record_device(args))
    return args


def _record_device(args: argparse.Namespace) -> str | None:
    """The device the records name: "cpu" for a run on the CPU (a GPU machine's ``--device cpu``
    included), else None (this machine's GPU)."""
    return "cpu" if torch.device(args.device).type == "cpu" else None


def build_model(args: argparse.Namespace, device: torch.device):
    """The family's model from its config, initial weights drawn on ``device`` from seed 0, in ``--dtype``."""
    import transformers

    fam = FAMILIES[args.family]
    dims = {**fam["dims"], **TINY} if args.tiny else fam["dims"]
    config = getattr(transformers, fam["config"])(**dims, attn_implementation=fam["attn"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])  # draw the weights in the training dtype: no fp32 copy
    try:
        with device:
            model = getattr(transformers, fam["model"])(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(device=device, dtype=DTYPES[args.dtype])


def fingerprint(model) -> float:
    """A fingerprint of the weights (sum of |w|, each parameter weighted by its position): variants
    that built the same initial weights show the same number."""
    return sum((i + 1) * p.detach().double().abs().sum().item() for i, p in enumerate(model.parameters()))


def apply_variant(variant: str, model):
    if variant == "liger-kernel":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)  # rope, rms_norm, swiglu/geglu, fused linear CE
    elif variant in ("liger-portable", "liger-portable-kernels"):
        from liger_portable import functional
        from liger_portable.transformers import patch

        if variant == "liger-portable-kernels":
            functional.UNDER_COMPILE = "kernels"
        model = patch(model)
    return model


def make_optimizer(model, lr: float) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):  # fused not supported for this device / dtype
        return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: build, patch, train; the result as a JSON-friendly dict, with
    status "ok", "unavailable" (the variant cannot be set up here) or "failed" (it broke while running)."""
    variant, device = args.worker, torch.device(args.device)
    out: dict = {"variant": variant, "status": "ok"}
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        import transformers
    except ImportError as e:
        return {**out, "status": "unavailable", "reason": f"transformers missing: {e}"}
    out["transformers"] = transformers.__version__
    try:
        model = build_model(args, device)
        out["fingerprint"] = fingerprint(model)
        out["params"] = sum(p.numel() for p in model.parameters())
    except Exception as e:  # noqa: BLE001 - e.g. a config this transformers version refuses
        return {**out, "status": "failed", "reason": f"building the model: {_reason(e)}"}
    try:
        model = apply_variant(variant, model)
    except ImportError as e:
        return {**out, "status": "unavailable", "reason": _reason(e)}
    if args.compile:
        mode = None if args.compile == "default" else args.compile
        for part in (model.model.layers if args.compile_scope == "layers" else [model]):
            part.compile(mode=mode)
    mem = getattr(torch, device.type) if device.type != "cpu" else None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    opt = make_optimizer(model, args.lr)
    model.train()
    if mem is not None:
        mem.synchronize()
        mem.reset_peak_memory_stats()
    losses, step_s = [], []
    total = args.warmup + args.steps
    try:
        for step in range(total):
            if mem is not None:
                mem.synchronize()
            t0 = time.perf_counter()
            if args.compile == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
            res = model(input_ids=ids, labels=ids, use_cache=False)  # training: no KV cache
            # Only the loss lives on, as in a trainer: HF's bf16 logits, which the backward does
            # not need (the loss upcasts its own copy), are freed before it.
            loss, out["logits_materialised"] = res.loss, res.logits is not None
            del res
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mem is not None:
                mem.synchronize()
            step_s.append(time.perf_counter() - t0)
            losses.append(loss.item())
            del loss
            print(f"  {variant:<15} step {step + 1:>3}/{total}  loss {losses[-1]:.4f}  {1e3 * step_s[-1]:8.1f} ms",
                  flush=True)
    except Exception as e:  # noqa: BLE001 - out of memory, a kernel that fails on this device: report it
        if variant == "liger-kernel" and device.type == "cpu":  # its Triton kernels take GPU tensors only
            out |= {"status": "unavailable", "reason": f"needs a GPU ({_reason(e)})"}
        else:
            out |= {"status": "failed", "reason": _reason(e)}
    out |= {"losses": losses, "step_ms": [1e3 * s for s in step_s]}
    timed = step_s[args.warmup:]
    if timed and out["status"] == "ok":
        med = statistics.median(timed)
        out |= {"median_ms": 1e3 * med, "tokens_per_s": args.batch * args.seq / med}
    if mem is not None:
        out |= {"peak_gib": mem.max_memory_allocated() / 2**30, "peak_reserved_gib": mem.max_memory_reserved() / 2**30}
    if args.profile and out["status"] == "ok" and mem is not None:
        out["profile"] = profile_steps(model, opt, ids, variant, steps=2)
    return out


def profile_steps(model, opt, ids: torch.Tensor, variant: str, steps: int) -> dict:
    """``steps`` more training steps under torch.profiler: wall time, device-busy time and the kernels
    with the most device time per step (printed, and returned for the JSON)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    # Device-side events only (kernels, memcpy): an aten op also reports its kernels' time as its own.
    kernels = [e for e in prof.key_averages()
               if e.self_device_time_total > 0 and getattr(e, "device_type", None) == DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    top = [{"name": e.key[:90], "calls": e.count // steps, "ms": e.self_device_time_total / 1e3 / steps}
           for e in kernels[:25]]
    print(f"  {variant} profile: {wall_ms:.1f} ms a step (profiled), device busy {busy_ms:.1f} ms "
          f"({100 * busy_ms / wall_ms:.0f}%); kernels by device time per step:")
    for k in top:
        print(f"    {k['ms']:8.3f} ms  {k['calls']:5d} calls  {k['name']}")
    # Host side: the operators with the most self CPU time (where a host-bound step's time goes).
    host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    host.sort(key=lambda e: -e.self_cpu_time_total)
    top_host = [{"name": e.key[:90], "calls": e.count // steps, "ms": e.self_cpu_time_total / 1e3 / steps}
                for e in host[:20]]
    print(f"  {variant} host: operators by self CPU time per step:")
    for k in top_host:
        print(f"    {k['ms']:8.3f} ms  {k['calls']:5d} calls  {k['name']}")
    return {"wall_ms": wall_ms, "busy_ms": busy_ms, "top": top, "top_host": top_host}


def run_variant(variant: str, args: argparse.Namespace, argv: list[str]) -> dict:
    """``variant`` in a fresh subprocess of this script; its JSON result (or why there is none)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", variant, "--result-file", path]
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=args.variant_timeout).returncode
        except subprocess.TimeoutExpired:
            return {"variant": variant, "status": "failed", "reason": f"timed out after {args.variant_timeout:.0f} s"}
        if not os.path.exists(path):
            return {"variant": variant, "status": "failed", "reason": f"subprocess exited {rc} without a result"}
        with open(path) as f:
            out = json.load(f)
        out["wall_s"] = time.perf_counter() - t0
        return out


def combine(runs: list[dict]) -> dict:
    """One variant's result over its repeated runs: the first run's fields (loss curve, status, ...),
    with tokens/s and step time the median over the runs that succeeded, the spread of tokens/s, and
    the largest peak memory. Not ok if any run was not."""
    out = dict(runs[0])
    bad = next((r for r in runs if r["status"] != "ok"), None)
    if bad is not None:
        return {**out, "status": bad["status"], "reason": bad.get("reason", "")}
    tps = [r["tokens_per_s"] for r in runs if r.get("tokens_per_s")]
    if tps:
        out |= {"tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
                "median_ms": statistics.median(r["median_ms"] for r in runs if "median_ms" in r)}
    peaks = [r["peak_gib"] for r in runs if "peak_gib" in r]
    if peaks:
        out["peak_gib"] = max(peaks)
    return out


def report(args: argparse.Namespace, results: list[dict]) -> str:
    from liger_portable.demo import TOLERANCE

    tol = TOLERANCE[DTYPES[args.dtype]]
    by = {r["variant"]: r for r in results}
    hf = by.get("hf", {})
    n = args.loss_steps
    lines = []
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        tps = r.get("tokens_per_s")
        speedup = f"x{tps / hf['tokens_per_s']:.2f}" if ok and hf.get("tokens_per_s") else ""
        diff = ""
        if r is not hf and hf.get("losses") and r.get("losses"):
            pairs = list(zip(hf["losses"][:n], r["losses"][:n]))
            d = max(abs(a - b) for a, b in pairs)
            rel = max(abs(a - b) / abs(a) for a, b in pairs)
            r["max_loss_diff"], r["max_rel_loss_diff"] = d, rel
            diff = f"{d:.2e} ({'matches' if rel <= tol else 'DIFFERS'})"
        if "fingerprint" in r and "fingerprint" in hf and r["fingerprint"] != hf["fingerprint"]:
            diff += " (initial weights differ!)"
        runs = r.get("tokens_per_s_runs", [])
        spread = f" [{min(runs):,.0f}, {max(runs):,.0f}]" if len(runs) > 1 else ""
        rows.append([
            _label(args, r["variant"]), f"{tps:,.0f}{spread}" if tps else "", f"{r['median_ms']:.1f}" if ok and "median_ms" in r else "",
            f"{r['peak_gib']:.1f}" if "peak_gib" in r else "n/a", speedup, diff,
            "ok" if ok else f"{r['status']}: {r.get('reason', '')}",
        ])
    lines.append(markdown_table(
        ["variant", "tokens/s" + (f" (median [min, max] of {args.repeats} runs)" if args.repeats > 1 else ""),
         "median step ms", "peak GiB", "vs HF", f"max |loss diff| vs HF, {n} steps", "status"], rows))
    curves = [r for r in results if r.get("losses")]
    if curves:
        lines.append("")
        lines.append(markdown_table(["step"] + [r["variant"] for r in curves],
                                    [[i] + [f"{r['losses'][i]:.4f}" if i < len(r["losses"]) else "" for r in curves]
                                     for i in range(min(n, max(len(r["losses"]) for r in curves)))]))
    goal = GOAL.get(args.family)
    ours = by.get("liger-portable", {})
    if goal and not args.tiny:
        tps, peak = ours.get("tokens_per_s"), ours.get("peak_gib")
        verdict = ("met" if tps and peak is not None and tps >= goal["tokens_per_s"] and peak <= goal["peak_gib"]
                   and ours.get("max_rel_loss_diff", 1.0) <= tol else "NOT met")
        lk = by.get("liger-kernel", {}).get("tokens_per_s")
        vs_lk = f", x{tps / lk:.2f} over liger-kernel" if tps and lk else ""
        lines.append(f"\ngoal (liger-portable, {args.family}): >= {goal['tokens_per_s']:,} tokens/s at <= "
                     f"{goal['peak_gib']} GiB peak, loss curve within {tol:g} of HF's: "
                     f"{f'{tps:,.0f}' if tps else '-'} tokens/s{vs_lk}, "
                     f"{f'{peak:.1f}' if peak is not None else '-'} GiB: {verdict}")
    return "\n".join(lines)


def _label(args: argparse.Namespace, variant: str) -> str:
    name = {"hf": "hugging-face", "liger-portable-kernels": "liger-portable"}.get(variant, variant)
    if args.compile:
        name = f"{name} + compile" + ("" if args.compile == "default" else f" ({args.compile})")
        name += " per layer" if args.compile_scope == "layers" else ""
    if variant == "liger-portable-kernels":
        name += ", our norms, GLU and RoPE (UNDER_COMPILE=kernels)"
    return name + (" (cuDNN attention off)" if args.no_cudnn_attention else "")


def records(args: argparse.Namespace, results: list[dict]) -> list[dict]:
    """One results-log record per variant that ran: tokens/s, with peak memory, step time and the
    loss difference from Hugging Face's curve (``report`` computes it) as extras."""
    hf = next((r.get("tokens_per_s") for r in results if r["variant"] == "hf"), None)
    shape = f"{FAMILIES[args.family]['ref']} dims, {args.batch}x{args.seq}"
    out = []
    for r in results:
        if r["status"] != "ok" or not r.get("tokens_per_s"):
            continue
        prof = r.get("profile")
        runs = r.get("tokens_per_s_runs", [])
        out.append(record(
            "train_step", shape, _label(args, r["variant"]), "tokens_per_s",
            round(r["tokens_per_s"], 1), device=_record_device(args), dtype=args.dtype, peak_gib=round(r["peak_gib"], 3) if "peak_gib" in r else None,
            median_step_ms=round(r["median_ms"], 1), vs_hf=round(r["tokens_per_s"] / hf, 3) if hf else None,
            max_loss_diff=float(f"{r['max_loss_diff']:.3g}") if "max_loss_diff" in r else None,
            gpu_busy_pct=round(100 * prof["busy_ms"] / prof["wall_ms"], 1) if prof else None,
            spread=[round(min(runs), 1), round(max(runs), 1)] if len(runs) > 1 else None,
            rounds=len(runs) if len(runs) > 1 else None,
            run=f"fused AdamW lr {args.lr:g}, {args.warmup} warm-up + {args.steps} timed steps"
                + (", cuDNN attention off" if args.no_cudnn_attention else "")
                + (f", median of {len(runs)} interleaved runs" if len(runs) > 1 else "")))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        result = worker(args)
        with open(args.result_file, "w") as f:
            json.dump(result, f)
        return 0
    env = environment()
    fam = FAMILIES[args.family]
    what = "tiny config (plumbing check, timings mean nothing)" if args.tiny else f"{fam['ref']} dimensions"
    print(f"{env}\ntraining step: {args.family}, {what}, {fam['attn']} attention, batch {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"fused AdamW lr {args.lr:g}, {args.warmup} warm-up + {args.steps} timed steps on {args.device}")
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for i in range(args.repeats):  # interleaved: each round runs every variant once
        for variant in args.variants:
            print(f"{variant}" + (f" (run {i + 1}/{args.repeats})" if args.repeats > 1 else "") + ":", flush=True)
            r = run_variant(variant, args, argv)
            runs[variant].append(r)
            if r["status"] != "ok":
                print(f"  {variant}: {r['status']}: {r.get('reason', '')}")
    results = [combine(rs) for rs in runs.values()]
    table = report(args, results)
    print(table)
    if not args.tiny:
        print(f"results: {save_records(f'train_step_{args.family}', records(args, results))}")
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
