"""Fused linear preference, RL and distillation losses (DPO, ORPO, SimPO, CPO, KTO, GRPO, JSD) on the LM head: time and memory, side by side.

For each loss, forward + backward from Python at a 7B-class head (H 4096, V 128256, 2 x 4 x 2048
tokens: 4 chosen and 4 rejected sequences, half of each a prompt), in bf16:

* **liger-portable**: ``liger_portable.chunked_loss`` (the fused linear cross-entropy's kernels with
  ``reduction="none"``, the loss on the sequence log-probabilities);
* **liger-kernel**: ``liger_kernel.chunked_loss`` (its chunked PyTorch, ``compiled=True`` as its default);
* **torch**: the unfused loss from the full logits (``log_softmax`` in float32), as TRL computes it
  without liger; skipped above ``--skip-unfused-over-gib`` of float32 logits.

Median ms over repeated calls and the peak memory beyond the inputs (the weight gradient included),
each implementation measured for memory from no gradients after one warm-up call. Records go to the results log
(``fwd_bwd_eager_ms`` with ``peak_mib``): ``$OUT/preference_loss.jsonl`` if OUT is set.

    python scripts/bench_preference_loss.py [--losses dpo,orpo,simpo,cpo,kto,grpo,jsd] [--hidden 4096] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from benchlib import environment, peak_extra_mib, require_gpu, save_records, timing_records

from liger_portable import chunked_loss as C

IGNORE = -100


def _unfused(kind: str):
    """The loss from the full logits (policy in float32 log-softmax), the same formulas."""

    def loss(h, w, t, ref=None, extra=None):
        n = h.shape[0] // 2
        logp = torch.log_softmax((h @ w.T).float(), -1)
        mask = t != IGNORE
        tok = logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
        if kind == "grpo":  # dapo, token level, beta 0.04 against the reference's log-probs
            ids, adv, old, ref_tok = extra
            tok = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(tok - old)
            a = adv.unsqueeze(1)
            per = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.04 * (torch.exp(ref_tok - tok) - (ref_tok - tok) - 1)
            return (per * mask).sum() / mask.sum()
        if kind == "jsd":  # beta 0.5, hard and soft weights 0.5, the teacher a second head
            th, tw = extra
            hh, tt = h.reshape(-1, h.shape[-1]), t.reshape(-1)
            s_log = torch.log_softmax((hh @ w.T).float(), -1)
            with torch.no_grad():
                t_log = torch.log_softmax((th.reshape(-1, th.shape[-1]) @ tw.T).float(), -1)
            keep = (tt != IGNORE).float()
            hard = -(s_log.gather(-1, tt.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum()
            log_m = torch.logsumexp(torch.stack([s_log, t_log]), 0) - math.log(2)
            soft = 0.5 * (t_log.exp() * (t_log - log_m)).sum(-1) + 0.5 * (s_log.exp() * (s_log - log_m)).sum(-1)
            return 0.5 * (hard + (soft * keep).sum()) / keep.sum()
        if kind == "kto":
            labels = extra
            seq = tok.sum(-1)
            return (1 - torch.sigmoid(0.1 * seq * (labels.float() * 2 - 1))).mean()
        average = kind in ("orpo", "simpo")
        seq = tok.sum(-1) / (mask.sum(-1).clamp(min=1) if average else 1)
        nll = -tok[:n].sum() / mask[:n].sum()
        if kind == "dpo":
            with torch.no_grad():
                rlogp = torch.log_softmax((ref[0] @ ref[1].T).float(), -1)
                rseq = (rlogp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum(-1)
            return C.dpo_pair_losses(seq[:n], seq[n:], rseq[:n], rseq[n:], 0.1)[0].mean()
        if kind == "orpo":
            return nll + C.orpo_pair_losses(seq[:n], seq[n:], 0.1)[0].mean()
        if kind == "simpo":
            return nll + C.simpo_pair_losses(seq[:n], seq[n:], 0.1, 0.5, 0.0)[0].mean()
        return nll + C.cpo_pair_losses(seq[:n], seq[n:], 0.1, 0.0)[0].mean()

    return loss


def _impls(kind: str, h, w, t, ref, extra):
    ours = {
        "dpo": lambda: C.LigerFusedLinearDPOLoss()(w, h, t, None, *ref)[0],
        "orpo": lambda: C.LigerFusedLinearORPOLoss()(w, h, t)[0],
        "simpo": lambda: C.LigerFusedLinearSimPOLoss()(w, h, t)[0],
        "cpo": lambda: C.LigerFusedLinearCPOLoss()(w, h, t)[0],
        "kto": lambda: C.LigerFusedLinearKTOLoss()(h, w, t, None, extra)[0],
        "jsd": lambda: C.LigerFusedLinearJSDLoss()(h.view(-1, h.shape[-1]), w, extra[0].view(-1, h.shape[-1]), extra[1], t.view(-1)),
        "grpo": lambda: C.LigerFusedLinearGRPOLoss()(h, w, extra[0], t != IGNORE, extra[1], None, extra[3], extra[2])[0],
    }[kind]
    out = {"liger-portable": ours}
    try:
        import liger_kernel.chunked_loss as LK

        cls = {"dpo": LK.LigerFusedLinearDPOLoss, "orpo": LK.LigerFusedLinearORPOLoss,
               "simpo": LK.LigerFusedLinearSimPOLoss, "cpo": LK.LigerFusedLinearCPOLoss,
               "kto": LK.LigerFusedLinearKTOLoss, "grpo": LK.LigerFusedLinearGRPOLoss,
               "jsd": LK.LigerFusedLinearJSDLoss}[kind]
        module = cls()
        out["liger-kernel"] = {
            "dpo": lambda: module(w, h, t, None, *ref)[0],
            "kto": lambda: module(h, w, t, None, extra)[0],
            "jsd": lambda: module(h.view(-1, h.shape[-1]), w, extra[0].view(-1, h.shape[-1]), extra[1], t.view(-1)),
            "grpo": lambda: module(h, w, extra[0], t != IGNORE, extra[1], None, extra[3], extra[2])[0],
        }.get(kind, lambda: module(w, h, t)[0])
    except Exception as e:  # noqa: BLE001 - the peer is optional
        print(f"  liger-kernel unavailable: {type(e).__name__}: {e}")
    unfused = _unfused(kind)
    out["torch"] = lambda: unfused(h, w, t, ref, extra)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--losses", default="dpo,orpo,simpo,cpo,kto,grpo,jsd")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per implementation (median)")
    ap.add_argument("--skip-unfused-over-gib", type=float, default=40.0)
    args = ap.parse_args(argv)
    require_gpu(ap.prog)
    print(environment())
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    n2, T, H, V = 2 * args.pairs, args.seq, args.hidden, args.vocab
    h = torch.randn(n2, T, H, device=dev, dtype=dt, generator=g).requires_grad_()
    w = (torch.randn(V, H, device=dev, dtype=dt, generator=g) / H**0.5).requires_grad_()
    t = torch.randint(0, V, (n2, T), device=dev, generator=g)
    t[:, : T // 2] = IGNORE
    ref = (h.detach() + 0.1 * torch.randn_like(h), w.detach() + 0.01 * torch.randn_like(w))
    shape = f"{args.pairs}+{args.pairs} x {T} x {H} x {V}"
    logits_gib = n2 * T * V * 4 / 2**30
    records = []
    ids = torch.where(t == IGNORE, 0, t)
    extras = {
        "kto": torch.arange(n2, device=dev) % 2 == 0,
        # GRPO: sampled ids, advantages, the old policy's and the reference's per-token log-probs
        "grpo": (ids, torch.randn(n2, device=dev), -torch.rand(n2, T, device=dev) * 8, -torch.rand(n2, T, device=dev) * 8),
        "jsd": ref,  # the teacher: a second head of the same size
    }
    for kind in args.losses.split(","):
        print(f"{kind}, {shape} (bf16):")
        for name, fn in _impls(kind, h, w, t, ref, extras.get(kind)).items():
            if name == "torch" and logits_gib > args.skip_unfused_over_gib:
                print(f"  {name}: skipped ({logits_gib:.0f} GiB of float32 logits)")
                continue

            def step():
                h.grad = w.grad = None
                fn().backward()

            try:
                step()  # compiles and tunes outside the memory figure
                peak = peak_extra_mib(step, (h, w))
                times = []
                for _ in range(args.calls):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    times.append(1e3 * (time.perf_counter() - t0))
            except torch.OutOfMemoryError:
                print(f"  {name}: out of memory")
                torch.cuda.empty_cache()
                continue
            ms = statistics.median(times)
            print(f"  {name:15s} {ms:8.2f} ms  {peak:8.0f} MiB beyond the inputs")
            records += timing_records(f"{kind}_loss", shape, name, ms, peak_mib=peak,
                                      note=f"median of {args.calls} calls, each between synchronisations")
    print(f"results: {save_records('preference_loss', records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
