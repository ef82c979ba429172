"""Benchmark: Composer's DecoupledAdamW against torch's multi-tensor AdamW, side by side (issue 31.4).

    .venv/bin/python tools/bench/bench_optimizer.py                   # Llama-3.2-1B's tensors at CPU widths
    .venv/bin/python tools/bench/bench_optimizer.py --device cuda     # on a GPU: torch's fused AdamW
    .venv/bin/python tools/bench/bench_optimizer.py --quick           # smoke run

An optimizer step is one pass over the model's parameter tensors. Composer's DecoupledAdamW loops
over them in Python, about ten kernels and one `.item()` (a host sync on a GPU: the step count) per
tensor; torch's fused AdamW (what `optimizer.name: adamw` builds, on CUDA and on the CPU) runs one
multi-tensor kernel per step. On a GPU a step is bound by launches and syncs, which this script
counts (aten ops dispatched, host syncs:
`tools/bench/step_audit.py`, emulated on a CPU) beside the times. The model: Llama-3.2-1B's parameter
tensors (16 blocks, tied embeddings: 146 tensors) at `--hidden` (default 64, where per-tensor
overhead dominates as on a GPU) and at `--wide` (512: the arithmetic shows). The two optimizers step
the same gradients, interleaved, and their parameters are compared after the timed steps (the
update is the same with torch's weight decay = Composer's / initial lr; tests/training/
test_optimizer_equivalence.py). Medians; on a shared machine compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

LR, WEIGHT_DECAY = 4e-4, 4e-5  # yamls/foundry/llama1b_dolma.yaml's learning rate and DecoupledAdamW decay (torch AdamW's 0.1)


def _model(hidden: int, layers: int, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32), num_key_value_heads=max(1, hidden // 128), tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device)


def _optimizers(params_a, params_b, device: str):
    from composer.optim import DecoupledAdamW

    from composer_algos.builders import build_optimizer

    composer = DecoupledAdamW(params_a, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WEIGHT_DECAY)
    torch_ = build_optimizer(params_b, name="adamw", lr=LR, betas=[0.9, 0.95], eps=1e-8, weight_decay=WEIGHT_DECAY / LR)
    for opt in (composer, torch_):  # the schedulers' LambdaLR sets it: Composer's decay reads it
        for group in opt.param_groups:
            group.setdefault("initial_lr", LR)
    return {"decoupled_adamw": composer, "adamw": torch_}


def _counts(opt, params, device: str) -> tuple[int, int]:
    """`(aten ops, host syncs)` of one step (syncs: torch's own on CUDA, emulated elsewhere)."""
    import torch
    from step_audit import OpCount, SyncAudit, cuda_sync_count

    ops = OpCount()
    if device == "cuda":
        with ops:
            syncs = cuda_sync_count(opt.step)
        return ops.ops, syncs
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    on_device_step = type(opt).__name__ == "DecoupledAdamW" or any(g.get("fused") for g in opt.param_groups)
    device_tensors = list(params) + [t for t in state if t.dim() > 0 or on_device_step]
    audit = SyncAudit(device_tensors, pause=ops.pause)
    with ops, audit:
        opt.step()
    return ops.ops, sum(n for (kind, _s, _c), n in {**audit.events, **audit.other}.items() if kind in ("sync", "h2d"))


def bench(hidden: int, layers: int, steps: int, device: str) -> dict:
    import torch

    models = {name: _model(hidden, layers, device) for name in ("decoupled_adamw", "adamw")}
    params = {name: list(m.parameters()) for name, m in models.items()}
    opts = _optimizers(params["decoupled_adamw"], params["adamw"], device)
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen, device=device) * 1e-2 for p in params["adamw"]] for _ in range(2)]

    def step(name: str, i: int) -> None:
        for p, g in zip(params[name], grads[i % 2]):
            p.grad = g.clone()
        opts[name].step()

    for name in opts:  # warm-up: state allocated, kernels loaded
        step(name, 0)
    counts = {name: _counts(opts[name], params[name], device) for name in opts}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(steps):
        for name in opts:
            for p, g in zip(params[name], grads[i % 2]):
                p.grad = g.clone()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opts[name].step()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    gap = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(*params.values()))
    return {
        "tensors": len(params["adamw"]),
        "numel": sum(p.numel() for p in params["adamw"]),
        "ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
        "counts": counts,
        "gap": gap,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the narrow model (default 64)")
    parser.add_argument("--wide", type=int, default=512, help="hidden size of the wide model (default 512; 0: none)")
    parser.add_argument("--layers", type=int, default=16, help="blocks (default 16, Llama-3.2-1B's)")
    parser.add_argument("--steps", type=int, default=21, help="timed steps of each optimizer, interleaved (default 21)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 blocks, hidden 32, no wide model, 3 steps")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.quick:
        args.hidden, args.wide, args.layers, args.steps = 32, 0, 2, 3
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {args.device} ({where}); lr {LR}, DecoupledAdamW weight decay {WEIGHT_DECAY} "
          f"= torch AdamW {WEIGHT_DECAY / LR:g}; medians of {args.steps} interleaved steps")
    print(f"{'hidden':>7}{'tensors':>8}{'params':>11}{'optimizer':>17}{'ms/step':>10}{'aten ops':>10}{'syncs':>7}"
          f"{'vs Composer':>13}")
    for hidden in [h for h in (args.hidden, args.wide) if h]:
        row = bench(hidden, args.layers, args.steps, args.device)
        base = row["ms"]["decoupled_adamw"]
        for name in ("decoupled_adamw", "adamw"):
            ops, syncs = row["counts"][name]
            print(f"{hidden:>7}{row['tensors']:>8}{row['numel']:>11}{name:>17}{row['ms'][name]:>10.2f}{ops:>10}{syncs:>7}"
                  f"{row['ms'][name] / base:>12.2f}x")
        print(f"{'':>7} parameters after {args.steps + 2} steps: largest relative difference {row['gap']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
