"""``liger-portable demo``: train a small Llama-style model with and without liger-portable.

    liger-portable demo                       # GPU if there is one, else the CPU
    liger-portable demo --steps 50 --json     # machine-readable
    liger-portable demo --device cpu          # the PyTorch fallback, on any machine

The model is a Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` in code (nothing is
downloaded), sized for the device. It trains twice from the same initial weights on the same fixed
batch (counting sequences, so the loss visibly drops) with AdamW: once as Hugging Face ships it,
once patched by :func:`liger_portable.transformers.patch`. The demo prints the two loss curves side
by side, tokens/s (median over the steps after warm-up), peak device memory, and exits 1 if the
curves differ by more than the tolerance of the dtype (see ``TOLERANCE``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time

import torch

from ._checks import HF_INSTALL_HINT
from ._dispatch import use_kernels
from ._arguments import DEMO_DTYPES, demo_parser, run_reported
from .hardware import PlatformError, platform

# Model and batch per device. A training step must keep the GPU busy for the kernels to show: on an
# H200 the ~150M-parameter model below spends two thirds of its step waiting for the host to launch
# kernels (each Triton launch costs more host time than an aten one), so GPUs with the memory for it
# train a ~0.5B model (491.8M parameters) on 16K tokens a step (Hugging Face's run peaks near 30 GiB
# there).
# CPU: a toy that trains 10 steps in about a second.
SIZES = {
    "gpu": {"model": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000),
            "batch": 8, "seq": 2048, "dtype": "bfloat16", "steps": 20},
    "gpu-small": {"model": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                                num_key_value_heads=4, vocab_size=32000),
                  "batch": 8, "seq": 1024, "dtype": "bfloat16", "steps": 20},
    "cpu": {"model": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000),
            "batch": 4, "seq": 128, "dtype": "float32", "steps": 10},
}
LARGE_GPU_GIB = 48  # device memory from which the demo trains SIZES["gpu"], below it SIZES["gpu-small"]
DTYPES = {name: getattr(torch, name) for name in DEMO_DTYPES}
LR = 1e-3
# Largest allowed |loss HF - loss patched| per step, relative to the HF loss. The two runs do the same
# math in a different order, and AdamW carries each rounding difference into the next step's weights.
# fp32 (measured on the CPU: 1.5e-7 over 10 steps): 1e-4 leaves a wide margin and still catches small
# errors (one weight vector 1% off: 9e-4 within 3 steps; a norm epsilon of 1e-5 for 1e-6: 3e-4).
# bf16/fp16 weights: activations and weight updates are rounded at ~4e-3, so the curves drift apart;
# 3% is the limit. Measured on an H200 (bf16, lr 1e-3): the first 10 steps within 0.9% of the loss,
# but after a loss spike near step 18 the two runs had moved 6.6% apart (both still training; a bf16
# run is chaotic there: any rounding difference grows). So the check covers the first COMPARE_STEPS
# steps, as scripts/bench_train_step.py does; all steps are printed.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}
COMPARE_STEPS = 10
HF_MISSING = f"liger-portable demo needs Hugging Face transformers: {HF_INSTALL_HINT}"


def pick_device(arg: str | None) -> torch.device:
    """``arg`` as a torch device, or the detected GPU backend's current device, or the CPU."""
    p = platform()
    if arg is None:
        return torch.device(p.torch_device_type, p.device().index) if p.backend != "cpu" else torch.device("cpu")
    try:
        device = torch.device(arg)
    except RuntimeError as e:
        raise ValueError(f"--device {arg!r} is not a torch device ({e}); use e.g. cuda, cuda:1, xpu or cpu") from None
    if device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is None or not mod.is_available():
            raise ValueError(f"--device {arg!r}: no {device.type} device on this machine; use --device cpu")
    return device


def size_for(device: torch.device) -> str:
    """The key of ``SIZES`` for ``device``: its kind, and for a GPU its memory."""
    if device.type == "cpu":
        return "cpu"
    try:
        total = getattr(torch, device.type).get_device_properties(device).total_memory
    except (AttributeError, RuntimeError):  # a backend without the query: the model that fits anywhere
        return "gpu-small"
    return "gpu" if total >= LARGE_GPU_GIB * 2**30 else "gpu-small"


def batch(vocab: int, batch_size: int, seq: int, device: torch.device) -> torch.Tensor:
    """Fixed synthetic batch: each row counts up (mod vocab) from a seeded random start."""
    start = torch.randint(0, vocab, (batch_size, 1), generator=torch.Generator().manual_seed(0))
    return ((start + torch.arange(seq)) % vocab).to(device)


def train(model, ids: torch.Tensor, steps: int, label: str) -> dict:
    """``steps`` AdamW steps on ``ids``; per-step loss, step time in seconds and peak device memory."""
    device = ids.device
    mem = getattr(torch, device.type) if device.type != "cpu" else None
    if mem is not None:
        mem.synchronize(device)
        mem.reset_peak_memory_stats(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    losses, times = [], []
    tty = sys.stderr.isatty()  # progress on one line that updates in place; a line per step in a log
    for step in range(steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # .item() waits for the device
        times.append(time.perf_counter() - t0)
        line = f"  {label:<8} step {step + 1:>3}/{steps}  loss {losses[-1]:.4f}"
        print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    peak = mem.max_memory_allocated(device) if mem is not None else None
    return {"losses": losses, "step_s": times, "peak_bytes": peak}


def tokens_per_s(step_s: list[float], tokens: int) -> float:
    """Tokens per second from the median step time after the first warm-up steps (compilation,
    autotuning, allocator growth): up to 3 of them, never more than half of the run."""
    warm = min(3, (len(step_s) - 1) // 2)
    return tokens / statistics.median(step_s[warm:])


def main(argv: list[str] | None = None) -> int:
    """Run the demo (``liger-portable demo`` with these arguments, default the process's); returns the
    exit code (0 ok, 1 the loss curves differ, 2 cannot run, 130 interrupted)."""
    args = demo_parser().parse_args(argv)
    return run_reported(lambda: run_command(args))


def run_command(args: argparse.Namespace) -> int:
    """Run the demo for parsed arguments; returns the exit code."""
    try:
        import transformers  # noqa: F401
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print(HF_MISSING, file=sys.stderr)
        return 2
    try:
        from .transformers import patch
    except ImportError as e:
        print(f"liger-portable demo: liger_portable.transformers is not available ({e})", file=sys.stderr)
        return 2
    p = platform()
    try:
        device = pick_device(args.device)
        kernels = use_kernels(device)
        where = p.device(device.index).name if kernels else device.type
    except (ValueError, PlatformError) as e:
        print(f"liger-portable demo: error: {e}", file=sys.stderr)
        return 2
    sizes = SIZES[size_for(device)]
    size, seq, batch_size = sizes["model"], sizes["seq"], sizes["batch"]
    dtype = DTYPES[args.dtype or sizes["dtype"]]
    steps = args.steps or sizes["steps"]
    path = "liger-portable's Triton kernels" if kernels else "liger-portable's PyTorch fallback (no kernels)"

    def say(line: str = "") -> None:
        print(line, file=sys.stderr if args.json else sys.stdout)

    say(f"liger-portable: backend {p.backend} ({p.source}; hardware offers {p.detected})")
    say(f"device {device} ({where}): the patched model runs {path}")
    say(f"model: Llama-style, hidden {size['hidden_size']}, {size['num_hidden_layers']} layers, "
        f"{size['num_attention_heads']} heads ({size['num_key_value_heads']} kv), vocab {size['vocab_size']}; "
        f"batch {batch_size} x {seq} tokens, {str(dtype).removeprefix('torch.')}, AdamW lr {LR:g}, {steps} steps")

    config = LlamaConfig(**size, max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    initial = LlamaForCausalLM(config)  # fp32 on the CPU: the initial weights of both runs
    ids = batch(config.vocab_size, batch_size, seq, device)
    runs = {}
    for name in ("hf", "patched"):
        model = copy.deepcopy(initial).to(device=device, dtype=dtype)
        if name == "patched":
            model = patch(model)
        try:
            runs[name] = train(model, ids, steps, "HF" if name == "hf" else "patched")
        finally:
            if name == "patched":  # RoPE is patched module-wide: leave the process as we found it
                from .transformers._patch import revert

                revert()
        del model
        if device.type != "cpu":  # give the first run's memory back before the second one
            gc.collect()
            getattr(torch, device.type).empty_cache()

    hf, ours = runs["hf"]["losses"], runs["patched"]["losses"]
    pairs = list(zip(hf, ours))[:COMPARE_STEPS]
    diff = max(abs(a - b) for a, b in pairs)
    rel = max(abs(a - b) / abs(a) for a, b in pairs)
    ok = rel <= TOLERANCE[dtype]
    tps = {k: tokens_per_s(r["step_s"], batch_size * seq) for k, r in runs.items()}
    result = {
        "platform": p.describe(), "device": str(device), "device_name": where, "kernels": kernels,
        "config": {**size, "seq": seq, "batch": batch_size, "dtype": str(dtype).removeprefix("torch."),
                   "steps": steps, "lr": LR},
        "loss": {"hf": hf, "patched": ours}, "tokens_per_s": tps,
        "peak_memory_bytes": {k: r["peak_bytes"] for k, r in runs.items()},
        "compared_steps": len(pairs), "max_loss_diff": diff, "max_rel_loss_diff": rel, "rel_tolerance": TOLERANCE[dtype],
        "ok": ok,
    }
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(f"\n{'step':>4}  {'loss HF':>10}  {'loss patched':>12}  {'diff':>8}")
        for i, (a, b) in enumerate(zip(hf, ours)):
            print(f"{i:>4}  {a:>10.4f}  {b:>12.4f}  {abs(a - b):>8.1e}")
        print(f"\n{'':<24}{'HF':>12}{'patched':>12}")
        # Without kernels both runs are PyTorch: a ratio would only show how the machine's load moved.
        speedup = f"  (x{tps['patched'] / tps['hf']:.2f})" if kernels else ""
        print(f"{'tokens/s (median)':<24}{tps['hf']:>12,.0f}{tps['patched']:>12,.0f}{speedup}")
        peaks = [r["peak_bytes"] for r in runs.values()]
        if None in peaks:
            print(f"{'peak memory':<24}{'n/a (CPU)':>12}{'n/a (CPU)':>12}")
        else:
            print(f"{'peak memory':<24}{peaks[0] / 2**30:>8.2f} GiB{peaks[1] / 2**30:>8.2f} GiB")
        if not kernels:
            print(f"(no kernels ran on {device}: both runs are PyTorch, so tokens/s shows no kernel speed-up; "
                  "run on a GPU for that)")
        verdict = "OK" if ok else "FAILED: the patched model does not train like Hugging Face's"
        print(f"max |loss diff| over the first {len(pairs)} steps {diff:.2e} ({rel:.1e} of the loss; tolerance "
              f"{TOLERANCE[dtype]:g} for {str(dtype).removeprefix('torch.')}): {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
