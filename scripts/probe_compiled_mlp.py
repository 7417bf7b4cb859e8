"""One patched Llama-3.2-1B decoder layer at 4 x 4096 tokens (bf16, SDPA): eager, compiled as the package
does it, and compiled with the fused MLP's product in Inductor's own formula (the package's code path
before the product became the ``liger_portable::glu_product`` kernel op, kept here for the A/B).

Under torch.compile the fused MLP recomputes its GLU product in the backward (a checkpoint region). With
the product in Inductor's formula, Inductor fuses that recompute with both GLU gradients into one kernel
while the saved gate and up activations are still alive, so the backward peaks two tokens x intermediate
tensors above the eager one (which writes the gradients over those activations). With our kernel op
doing the recompute, Inductor's gradient kernel is the saved activation's last reader and writes over it.

Printed per variant, in MiB: memory kept after the forward, the forward's peak, the backward's peak above
its start; the forward+backward time (median of 20, ms, eager calls); and the relative error of the
input, gate and down-projection gradients against eager. Records go to the results log (``$OUT`` when set).

    python scripts/probe_compiled_mlp.py     # about 60 s on an H100 (three compiles)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

import results_log
from benchlib import require_gpu
import liger_portable.functional as lp_functional
from liger_portable import fallback
from liger_portable.transformers import patch

MiB = 2**20
SHAPE = "Llama-3.2-1B dims decoder layer, 4x4096"
PACKAGE_GLU_DOWN = lp_functional.glu_down


def glu_down_inductor_product(act, a, b, down):
    """The fused MLP under torch.compile with the product in Inductor's formula (the A/B's "before")."""
    if not torch.compiler.is_compiling():
        return PACKAGE_GLU_DOWN(act, a, b, down)
    product = fallback.swiglu if act == "silu" else fallback.geglu
    return torch.nn.functional.linear(checkpoint(product, a, b, use_reentrant=False), down.weight, down.bias)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    require_gpu(ap.prog)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=1, vocab_size=1024, head_dim=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    patch(model)
    layer, rot = model.model.layers[0], model.model.rotary_emb
    x = torch.randn(4, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(4096, device="cuda")[None].expand(4, -1)
    with torch.no_grad():
        pe = rot(x, pos)
    g = torch.randn(4, 4096, 2048, device="cuda", dtype=torch.bfloat16)
    env = results_log.environment()
    records: list[dict] = []

    def run(l):
        out = l(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, tuple) else out

    def step(l):
        run(l).backward(g)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    def measure(l, name, ref=None):
        for _ in range(3):
            step(l)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = run(l)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        fwd_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y.backward(g)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        got = (x.grad.clone(), layer.mlp.gate_proj.weight.grad.clone(), layer.mlp.down_proj.weight.grad.clone())
        del y
        x.grad = None
        layer.zero_grad(set_to_none=True)
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(l)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        errs = None if ref is None else [
            float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, ref)]
        ms = statistics.median(times)
        print(f"{name:50s} kept {kept / MiB:8.1f}  fwd peak {fwd_peak / MiB:8.1f}  bwd peak over start "
              f"{bwd_peak / MiB:8.1f}  fwd+bwd {ms:7.2f} ms"
              + ("" if errs is None else "  rel.err vs eager " + " ".join(f"{e:.1e}" for e in errs)), flush=True)
        extra = dict(dtype="bfloat16", kept_mib=round(kept / MiB, 1), fwd_peak_mib=round(fwd_peak / MiB, 1),
                     grad_rel_err=None if errs is None else [round(e, 6) for e in errs],
                     note="scripts/probe_compiled_mlp.py: backward peak above its start, one layer")
        records.append(results_log.record("decoder_layer", SHAPE, name, "bwd_peak_mib",
                                          round(bwd_peak / MiB, 1), env=env, **extra))
        records.append(results_log.record("decoder_layer", SHAPE, name, "fwd_bwd_eager_ms", round(ms, 3),
                                          env=env, dtype="bfloat16", note="scripts/probe_compiled_mlp.py: median of 20"))
        return got

    ref = measure(layer, "liger-portable")
    for name, glu_down in (("liger-portable + compile (product in Inductor's formula)", glu_down_inductor_product),
                           ("liger-portable + compile", PACKAGE_GLU_DOWN)):
        lp_functional.glu_down = glu_down
        torch._dynamo.reset()
        measure(torch.compile(layer), name, ref)
    lp_functional.glu_down = PACKAGE_GLU_DOWN
    print("records:", results_log.save(records, "probe_compiled_mlp"))


if __name__ == "__main__":
    main()
