"""Benchmark per-example gradient features against a plain forward, the truncated batch backward, and torch.func.

Example:
    .venv/bin/python tools/bench/bench_features.py                 # both model sizes, CPU, 5 timed rounds
    .venv/bin/python tools/bench/bench_features.py --configs small --repeats 5 --device cuda
    .venv/bin/python tools/bench/bench_features.py --quick         # smoke run in seconds (tiny model), not a measurement

For each model (random Llama, vocab 8192, sequence 128, pool 32; "small": 4 blocks, hidden 256;
"large": 8 blocks, hidden 512; "llama1b_cpu" (not in the default --configs): Llama-3.2-1B's 16 blocks and
32/8 heads at hidden 64, vocab 4096, the 17 windows of 64 tokens its recipe's step scores), side by
side in one run:
  (a) forward     a plain no-grad forward of the pool (eval mode);
  (b) batch_grad  the same truncated forward (no graph below the last block) + backward computing only the
                  summed gradient of the target layers (the last block's linear layers);
  (c) feat_*      GradFeatureExtractor.compute on the pool (adam_optimizer normalisation with real optimizer
                  state, FJLT to the hidden size): `feat_exact` (every target exact), `feat_sketch` (every
                  target sketched, k=32), `feat_default` (the default 65536 threshold);
  (d) func        torch.func per-example gradients (vmap of grad) of the same parameters;
  (e) feat_compiled  feat_sketch with `compile_forward=True`: the blocks below the cut compiled
                  (`torch.compile`; on CUDA mode reduce-overhead), compiled in the warm-up call.
Counts (issue 31.2; what a GPU pays per call beyond the arithmetic): each method's aten ops in one
call, from torch.profiler's events (the compiled path's fused kernels are not aten ops; its matrix
products are), and on CUDA its kernel launches (cudaLaunchKernel and cudaGraphLaunch calls).
Timing: all methods of a model are set up in one process, warmed up, then run round-robin --repeats
times, so load changes on a shared machine hit them alike; the median and the min are reported and the
ratios use the median. Memory: each method runs once more in its own subprocess, which reports the
peak it added over its setup and warm-up: on CPU the rise of the peak RSS (/proc/self/status VmHWM,
reset through /proc/self/clear_refs; large allocations are forced to mmap so freed memory leaves the
RSS), on CUDA torch.cuda.max_memory_allocated above the allocated level. The exit code is 1 when a
method failed (its error is printed) or has no row.

`--quick` runs every method on a "tiny" model (2 blocks, hidden 64, vocab 512, sequence 32, pool 8),
one timed round, and one memory subprocess for all methods (each peak then includes the other
methods' setup): a check that every path runs, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "small": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4),
    "large": dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8),
    # Llama-3.2-1B's structure at CPU size (16 blocks, 32/8 heads; tools/bench/bench_step.py's llama1b_cpu), scoring
    # what its step scores: the 8 x 2 pool rows' and one validation row's 64-token windows.
    "llama1b_cpu": dict(num_hidden_layers=16, hidden_size=64, intermediate_size=256, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=2),
    # --quick only: every path in seconds.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=2, num_key_value_heads=2),
}
METHODS = ["forward", "batch_grad", "feat_exact", "feat_sketch", "feat_default", "func", "feat_compiled"]
VOCAB, SEQ, POOL = 8192, 128, 32
QUICK_SIZES = dict(vocab=512, seq=32, pool=8)  # with the tiny config
SIZES = {"llama1b_cpu": dict(vocab=4096, seq=64, pool=17)}  # (vocab, sequence, pool) other than the defaults
TARGETS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["small", "large"], choices=list(CONFIGS))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke run: the tiny model, 1 round, one memory subprocess (overrides --configs and --repeats)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_run_worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.configs, args.repeats = ["tiny"], 1

    results: dict[str, dict[str, dict]] = {}
    failed: list[str] = []
    for cfg in args.configs:
        job = dict(config=cfg, methods=args.methods, repeats=args.repeats, device=args.device, threads=args.threads)
        job.update(SIZES.get(cfg, {}))
        if args.quick:
            job.update(QUICK_SIZES)
        timings = _call_worker(dict(job, mode="time"))
        results[cfg] = {}
        if timings is None:  # the worker failed before timing anything: no memory runs either
            failed += [f"{cfg}/{method}" for method in args.methods]
            continue
        quick_mem = _call_worker(dict(job, mode="memory")) if args.quick else None
        for method in args.methods:
            mem = quick_mem if args.quick else _call_worker(dict(job, mode="memory", methods=[method]))
            if method not in timings or mem is None:
                failed.append(f"{cfg}/{method}")
                continue
            res = dict(timings[method], peak_mb=mem[method]["peak_mb"])
            results[cfg][method] = res
            print(f"[{cfg}] {method:<13} median {res['median_s'] * 1e3:9.1f} ms  (min {res['min_s'] * 1e3:9.1f})  "
                  f"peak +{res['peak_mb']:8.1f} MB", flush=True)
    _print_report(results)
    if failed:
        print(f"\nFAILED (no row; the errors are above on stderr): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _call_worker(job: dict) -> dict | None:
    """Run `_run_worker(job)` in a fresh interpreter; None (and the error on stderr) when it fails."""
    # glibc keeps freed heap memory, which a later run would reuse without raising the RSS; serving
    # every allocation above 64 KiB by mmap (returned on free) makes the RSS track live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], env=env,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(f"[{job['config']}/{job['mode']}/{job['methods']}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT ") :])


def _print_report(results: dict) -> None:
    print("\n| model | method | median ms | peak MB | / (a) forward | / (b) batch_grad | aten ops | launches |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cfg, res in results.items():
        a = res.get("forward", {}).get("median_s")
        b = res.get("batch_grad", {}).get("median_s")
        for method, r in res.items():
            ra = f"{r['median_s'] / a:.2f}" if a else "-"
            rb = f"{r['median_s'] / b:.2f}" if b else "-"
            print(f"| {cfg} | {method} | {r['median_s'] * 1e3:.1f} | {r['peak_mb']:.1f} | {ra} | {rb} | "
                  f"{r.get('aten_ops', '-')} | {r.get('launches', '-')} |")
    for cfg, res in results.items():
        eager, comp = res.get("feat_sketch"), res.get("feat_compiled")
        if eager and comp and comp.get("aten_ops"):
            line = (f"[{cfg}] feat_compiled / feat_sketch: time {comp['median_s'] / eager['median_s']:.2f}, "
                    f"aten ops {eager['aten_ops']} -> {comp['aten_ops']} ({eager['aten_ops'] / comp['aten_ops']:.2f}x fewer)")
            if comp.get("launches"):
                line += f", launches {eager['launches']} -> {comp['launches']} ({eager['launches'] / comp['launches']:.2f}x fewer)"
            print(line)
    print("\nTargets: (c)/(b) <= 1.2; (d)/(c) >= 5.")
    for cfg, res in results.items():
        b, d = res.get("batch_grad"), res.get("func")
        for method in ("feat_exact", "feat_sketch", "feat_default"):
            c = res.get(method)
            if c is None:
                continue
            parts = [f"[{cfg}] {method}:"]
            if b:
                parts.append(f"(c)/(b) = {c['median_s'] / b['median_s']:.2f}")
            if d:
                parts.append(f"(d)/(c) = {d['median_s'] / c['median_s']:.1f}")
            if "forward" in res:
                parts.append(f"(c)/(a) = {c['median_s'] / res['forward']['median_s']:.2f}")
            print("  ".join(parts))


def _run_worker(job: dict) -> dict:
    """Build the model and the methods; time them round-robin, or measure the memory each adds."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from transformers import LlamaConfig, LlamaForCausalLM

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    torch.manual_seed(0)
    vocab, seq, pool = job.get("vocab", VOCAB), job.get("seq", SEQ), job.get("pool", POOL)
    config = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="eager",
        **CONFIGS[job["config"]],
    )
    model = LlamaForCausalLM(config).to(device)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (pool, seq), generator=gen).to(device)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
    last = config.num_hidden_layers - 1
    target_names = [f"model.layers.{last}.{t}" for t in TARGETS]
    fns = {m: _make_method(m, model, batch, target_names) for m in job["methods"]}
    for fn in fns.values():
        fn()  # warm-up (also builds the extractor's cached projections)
    _sync(device)
    if job["mode"] == "memory":
        out = {}
        for method, fn in fns.items():
            base = memory_reset(device)
            fn()
            _sync(device)
            out[method] = {"peak_mb": (memory_peak(device) - base) / 2**20}
        return out
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(job["repeats"]):
        for method, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            times[method].append(time.perf_counter() - start)
    counts = {m: _profile_counts(fn, device) for m, fn in fns.items()}
    return {m: {"median_s": statistics.median(t), "min_s": min(t), **counts[m]} for m, t in times.items()}


def _profile_counts(fn, device) -> dict:
    """One call's aten ops (torch.profiler events named aten::*) and, on CUDA, its kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    names = [e.name for e in prof.events()]
    out = {"aten_ops": sum(n.startswith("aten::") for n in names)}
    if device.type == "cuda":
        out["launches"] = sum(n in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch") for n in names)
    return out


def _make_method(method: str, model, batch: dict, target_names: list[str]):
    """A zero-argument callable running one measurement of `method`."""
    import torch
    from torch.func import functional_call, grad, vmap

    from composer_algos.features import GradFeatureExtractor, per_example_losses, truncated_graph

    model.eval()
    modules = dict(model.named_modules())
    weights = [modules[n].weight for n in target_names]

    if method == "forward":
        def run():
            with torch.no_grad():
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        return run

    if method == "batch_grad":
        cut = model.model.layers[-1]

        def run():
            with truncated_graph(cut):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
                loss = per_example_losses(logits, batch["labels"]).sum()
                return torch.autograd.grad(loss, weights)
        return run

    if method.startswith("feat_"):
        # Real Adam state for the adam_optimizer normalisation: one training step on a few examples.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(input_ids=batch["input_ids"][:4], labels=batch["labels"][:4]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        threshold = {"feat_exact": 10**12, "feat_sketch": 0, "feat_default": 65536, "feat_compiled": 0}[method]
        extractor = GradFeatureExtractor(
            model, target_modules=[re.escape(n) + "$" for n in target_names], exact_max_numel=threshold,
            sketch_dim=32, normalization="adam_optimizer", chunk_size=len(batch["input_ids"]),
            compile_forward=method == "feat_compiled",
        )

        def run():
            G, _ = extractor.compute(batch, step=1, optimizer=opt)
            assert extractor.normalization_in_use.startswith("adam_optimizer")
            return G
        return run

    if method == "func":
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = dict(model.named_buffers())
        tp = {n + ".weight": params[n + ".weight"] for n in target_names}

        def loss_fn(tparams, ids_T, labels_T):
            out = functional_call(model, ({**params, **tparams}, buffers), (ids_T[None],), {"use_cache": False})
            return per_example_losses(out.logits, labels_T[None])[0]

        per_example = vmap(grad(loss_fn), in_dims=(None, 0, 0))

        def run():
            return per_example(tp, batch["input_ids"], batch["labels"])
        return run

    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def memory_reset(device) -> int:
    """Reset the peak counter; return the current level in bytes."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _proc_status_kb("VmRSS") * 1024


def memory_peak(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return _proc_status_kb("VmHWM") * 1024


def _proc_status_kb(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    assert match, key
    return int(match.group(1))


if __name__ == "__main__":
    raise SystemExit(main())
