"""The embedded demo: generate a multi-domain corpus, shard it, train a tiny Llama with PartitionSel.

Example:
    python tools/demo.py                       # everything under demo_out/, under 3 minutes on 2 idle cores
    python tools/demo.py --steps 100 --strategy random

Offline from end to end: the corpus is synthetic (tools/make_sample_corpus.py), the tokenizer is
the committed assets/tokenizer, and the model is built from a config (`yamls/testing/demo_dolma.yaml`,
150 steps, selection scoring each row's first 64 tokens). Training shows a progress
bar; Composer's per-step metrics and warnings go to `console.log` in the run directory (every
metric is also in `log-rank0.txt`, `selection_log.csv`, `eval_history.csv`). At the end it prints
the per-domain validation loss, the domain mixture PartitionSel induced next to the mixture of the
candidate pools it chose from, the wall time, and the paths of two plots (`mixture.png`,
`val_curves.png`) it writes into the run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ConsoleLogger's progress prefix, e.g. "[epoch=1][batch=12/300]:", and the train loss line.
_BATCH_RE = re.compile(r"\[batch=(\d+)/(\d+)\]")
_LOSS_RE = re.compile(r"Train loss/train/total: (\S+)")


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    # Imported after argument parsing so that --help answers at once.
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tools"))
    from sample_corpus import write_sample_corpus

    start = time.perf_counter()
    out: Path = args.out.resolve()
    corpus, shards, run_dir = out / "corpus", out / "shards" / "dolma", out / "runs" / f"demo-{args.strategy}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    print(f"[1/3] writing the synthetic corpus to {corpus}", flush=True)
    summary = write_sample_corpus(corpus, seed=0, scale=1.0)
    print("      " + ", ".join(f"{name} {n}" for name, n in summary.dolma_docs.items()) + " documents")

    shard_log = logs / "shard.log"
    print(f"[2/3] sharding the Dolma-style sources into {shards} (log: {shard_log})", flush=True)
    _run_logged(
        [
            sys.executable,
            str(REPO / "tools" / "shard.py"),
            "dolma",
            str(corpus / "dolma" / "documents"),
            "--out",
            str(shards),
            "--tokenizer",
            str(REPO / "assets" / "tokenizer"),
            "--max-seq-len",
            "128",
            "--val-count",
            "32",
            "--overwrite",
            "--no-progress",
        ],
        shard_log,
    )

    print(f"[3/3] training a tiny Llama for {args.steps} steps with strategy={args.strategy}", flush=True)
    # A fresh run directory: the history files are appended to, so a previous demo's would mix in.
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    console_log = run_dir / "console.log"
    eval_every = max(1, args.steps // 12)  # about a dozen points on the validation curves
    train_wall = _train_with_progress(
        [
            sys.executable,
            str(REPO / "train.py"),
            str(args.yaml),
            f"variables.shard_dir={shards}",
            f"max_duration={args.steps}ba",
            f"eval_interval={eval_every}ba",
            "console_log_interval=1ba",  # one record per step in console.log: the progress bar reads it
            "progress_bar=false",
            f"save_folder={run_dir}",
            "save_overwrite=true",
            f"seed={args.seed}",
            f"algorithms.data_selection.strategy={args.strategy}",
            # Score the first 64 of each row's 128 tokens, as the pretraining recipe does: the
            # features took 0.55 s a step against 0.92 s on whole rows (20 steps each, side by
            # side), which with 150 steps keeps the demo under 3 minutes on 2 cores.
            "algorithms.data_selection.features.score_window=64",
        ],
        console_log,
        args.steps,
    )
    print_summary(run_dir, train_wall, time.perf_counter() - start)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    """The demo's options: working directory, steps, strategy, seed and yaml."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "demo_out", help="working directory (default: demo_out/)"
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps (default: 150)")
    parser.add_argument(
        "--strategy",
        default="partitionsel",
        help="selection strategy: partitionsel, greats, id, iwd, gradnorm, colm, random, random_stratified, none",
    )
    parser.add_argument("--seed", type=int, default=17, help="training seed (default: 17)")
    parser.add_argument("--yaml", type=Path, default=REPO / "yamls" / "testing" / "demo_dolma.yaml")
    return parser


def print_summary(run_dir: Path, train_wall_s: float, total_wall_s: float) -> None:
    """Print the per-domain validation loss, the mixture table, the wall time and the plots' paths."""
    sys.path.insert(0, str(REPO / "tools"))
    import plots

    print()
    print_val_losses(run_dir)
    print()
    print_mixture(run_dir)
    print()
    results_file = run_dir / "eval_results.json"
    selection_s = (
        json.loads(results_file.read_text()).get("selection_time_s") if results_file.exists() else None
    )
    sel = f", of which selection {selection_s:.0f}s" if isinstance(selection_s, (int, float)) else ""
    print(f"wall time: {total_wall_s:.0f}s in all; training {train_wall_s:.0f}s{sel}")
    for name, plot in (
        ("mixture.png", lambda p: plots.plot_mixture(run_dir, p)),
        ("val_curves.png", lambda p: plots.plot_val_curves(run_dir, p)),
    ):
        try:
            print(f"plot: {plot(run_dir / name)}")
        except (OSError, ValueError, KeyError) as e:
            print(f"plot: could not write {run_dir / name}: {e}")
    print(f"run files (every metric, checkpoints, console.log): {run_dir}")


def print_val_losses(run_dir: Path) -> None:
    """Per-domain validation cross-entropy at the first and the last evaluation, with the change."""
    sys.path.insert(0, str(REPO / "tools"))
    from plots import read_eval_history

    curves = read_eval_history(run_dir)
    if not curves:
        print(f"Per-domain validation loss: none recorded (no {run_dir / 'eval_history.csv'})")
        return
    first_step = min(points[0][0] for points in curves.values())
    last_step = max(points[-1][0] for points in curves.values())
    print("Per-domain validation loss (cross-entropy, nats/token):")
    width = max(len(n) for n in curves) + 2
    print(f"{'domain':<{width}}{f'step {first_step}':>12}{f'step {last_step}':>12}{'change':>10}{'ppl':>10}")
    firsts, lasts = [], []
    for name, points in sorted(curves.items()):
        first, last = points[0][1], points[-1][1]
        firsts.append(first)
        lasts.append(last)
        print(
            f"{name:<{width}}{first:>12.4f}{last:>12.4f}{last - first:>+10.4f}{math.exp(min(last, 50)):>10.1f}"
        )
    f_avg, l_avg = sum(firsts) / len(firsts), sum(lasts) / len(lasts)
    print(
        f"{'average':<{width}}{f_avg:>12.4f}{l_avg:>12.4f}{l_avg - f_avg:>+10.4f}{math.exp(min(l_avg, 50)):>10.1f}"
    )


def print_mixture(run_dir: Path) -> None:
    """Print the induced mixture (mean over steps) next to the pools' mixture and the natural shares."""
    sys.path.insert(0, str(REPO / "tools"))
    from plots import read_mixture

    try:
        mix = read_mixture(run_dir)
    except FileNotFoundError:
        print(f"(no mixture files in {run_dir})")
        return
    json_mix = json.loads((run_dir / "mixture.json").read_text())
    names = mix["domains"]
    width = max([len(n) for n in names] + [6]) + 2
    print(f"Domain mixture over {json_mix['steps']} steps (method {json_mix['method']}):")
    print(f"{'domain':<{width}}{'natural':>10}{'pool':>10}{'selected':>10}{'sel/pool':>10}")
    for n in names:
        pool, selected = mix["pool_mean"][n], mix["selected_mean"][n]
        ratio = selected / pool if pool > 0 else math.nan
        print(f"{n:<{width}}{mix['natural'][n]:>10.3f}{pool:>10.3f}{selected:>10.3f}{ratio:>10.2f}")
    print(mixture_note(*_selection_settings(run_dir)))


def _selection_settings(run_dir: Path) -> tuple[str, object]:
    """(strategy, capacities) of the run's `algorithms.data_selection`, from its saved config.yaml."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    cfg = OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else {}
    selection = ((cfg or {}).get("algorithms") or {}).get("data_selection") or {}  # type: ignore[union-attr]
    return str(selection.get("strategy", "none")), selection.get("capacities")


def mixture_note(strategy: str, capacities: object) -> str:
    """One line under the mixture table: whether the selected shares are a finding or set by construction."""
    from composer_algos.selection import get_strategy

    if strategy == "none":
        return "The run trained on the whole pool, so its mixture is the pool's."
    policy = capacities.get("policy") if isinstance(capacities, dict) else capacities
    if not get_strategy(strategy).uses_capacities:
        return f"{strategy} draws without per-domain capacities, so its mixture follows the pool's up to chance."
    if policy in (None, "proportional"):
        return (
            "Proportional capacities (the default) fix each domain's share of the selection to its share of the "
            "pool: sel/pool = 1 by construction, not a finding. To let the selection choose the mixture, set "
            "algorithms.data_selection.capacities={policy: slack, factor: 2} (docs/results/mixtures.md)."
        )
    if policy == "slack":
        return "Slack capacities bound each domain's share; within them the selection chose the shares above."
    return f"The {policy} capacities set each domain's share, so the selected shares follow the policy."


def _train_with_progress(cmd: list[str], log_path: Path, steps: int) -> float:
    """Run train.py with its output in ``log_path``; show a progress bar read from that output."""
    from tqdm import tqdm

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with (
        open(log_path, "w") as log,
        tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True) as bar,
    ):
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        loss = ""  # the last training loss read: the postfix again once an evaluation is over
        try:
            for line in proc.stdout:
                log.write(line)
                if m := _BATCH_RE.search(line):
                    bar.set_postfix_str(loss, refresh=False)
                    bar.update(int(m.group(1)) - bar.n)
                elif line.startswith("[Eval"):
                    bar.set_postfix_str("evaluating", refresh=True)
                elif m := _LOSS_RE.search(line):
                    loss = f"loss {m.group(1)}"
                    bar.set_postfix_str(loss, refresh=False)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        tail = log_path.read_text().splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"training failed with exit code {rc}; full output in {log_path}")
    return time.perf_counter() - t0


def _run_logged(cmd: list[str], log_path: Path) -> None:
    """Run a command with its output in ``log_path``; on failure show the tail and stop."""
    with open(log_path, "w") as log:
        result = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        print("\n".join(log_path.read_text().splitlines()[-40:]), file=sys.stderr)
        raise SystemExit(
            f"command failed with exit code {result.returncode} (log {log_path}): {' '.join(cmd)}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
