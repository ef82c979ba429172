"""The device loop's round as three Triton kernels (`solver_loop: device_triton`, issue 31.3), checked without a GPU:
the kernels run in Triton's interpreter on CPU tensors, and compile for an H100 (sm_90) ahead of time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer_algos.selection.objective import build_objective
from composer_algos.selection.refit import default_grad_tol
from tests.common.paths import REPO_ROOT
from tests.selection.reference import make_instance
from tests.selection.test_active_set_device import _device_solve as _solve
from tests.selection.test_active_set_device import _select

triton = pytest.importorskip("triton")
omp_triton = pytest.importorskip("composer_algos.selection.omp_triton")

ETA = 0.5


# A minute or two on the 2-core VM: the interpreter runs each program of each launch in Python.
@pytest.mark.timeout(600)
def test_the_kernels_in_tritons_interpreter():
    """`omp_triton_interpreted.py` in a child process with ``TRITON_INTERPRET=1``: the kernels on CPU tensors
    pick what the eager rounds pick, repair and hand over as they do, and update every state tensor as they do."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", str(Path(__file__).parent / "omp_triton_interpreted.py")]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert re.search(r"\b12 passed\b", done.stdout) and "skipped" not in done.stdout, done.stdout[-3000:]


def test_off_the_interpreter_a_cpu_runs_the_eager_rounds(monkeypatch):
    """Triton runs on GPUs: on CPU tensors outside its interpreter, `device_triton` is the device loop's eager
    rounds, bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not omp_triton.kernels_available(torch.device("cpu"))
    features, val, dom = make_instance(3, 64, dim=64)
    a, b = (_select(features, val, dom, 16, loop) for loop in ("device_triton", "device"))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.weights, b.weights)


def test_compile_and_triton_are_exclusive():
    features, val, dom = make_instance(3, 24, dim=8)
    with pytest.raises(ValueError, match="compile and triton are two ways to run a round"):
        _solve(features, val, dom, 8, compile=True, triton=True)


_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1"}


def _launches(dtype: torch.dtype, kkt: bool, blocks: dict | None = None, n: int = 200) -> list[tuple]:
    """The three launches of one round, recorded (kernel, positional args, constexprs) instead of run."""
    from composer_algos.selection import active_set_device as asd

    features, val, dom = make_instance(0, n, dim=32, dtype=dtype)
    gram, mu, _ = build_objective(features, val, ETA)
    st = asd._initial_state(gram, mu, dom, torch.tensor([n // 5] * 3), n // 2, 1e-6, default_grad_tol(mu))
    step = omp_triton.TritonRound(st, (1e-12, 0.0), blocks)
    calls = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **constexprs: calls.append((self.fn, args, constexprs))

    step.kernels = tuple(Recorder(fn) for fn in omp_triton.KERNELS)
    step(kkt)
    return calls


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "dtype,kkt,blocks,n",
    [(torch.float32, False, None, 200), (torch.float32, True, None, 200), (torch.float64, True, None, 200)]
    + [(torch.float32, True, override, 200) for override in omp_triton.SWEEP]
    + [(torch.float32, True, None, 8)]  # a training step's pool: blocks of one program's partials, 8 elements
    + [(dt, False, {"fused": 1}, 200) for dt in (torch.float32, torch.float64)]  # the two-kernel rounds
    # The default and the sweep's other widths at a pool whose 551 slots fill their block, up to 1024 (at n = 200 a
    # block is cut to 128, the power of two above the 101 slots): the widest tiles, the most registers.
    + [(torch.float32, kkt, None, 1100) for kkt in (False, True)]
    + [(torch.float32, False, override, 1100) for override in omp_triton.SWEEP if "reduce" in override],
)
def test_the_kernels_compile_for_an_h100(dtype, kkt, blocks, n):
    """Triton's interpreter is not its compiler: it does not check that a loop keeps its variables' types, or
    that an operation has a GPU lowering. Each kernel, with the arguments a round passes (and the block sizes
    the benchmark's sweep tries), compiles for sm_90 (ahead of time: Triton's front end, its LLVM lowering and
    the bundled ptxas, with no GPU) to a cubin."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for fn, args, constexprs in _launches(dtype, kkt, blocks, n):
        warps = constexprs.pop("num_warps")  # a launch option, not a parameter
        jitted = triton.jit(fn)
        names = [p.name for p in jitted.params]
        signature, values = {}, dict(constexprs)
        for name, arg in zip(names, args):
            if isinstance(arg, torch.Tensor):
                signature[name] = _TYPES[arg.dtype]
            else:
                signature[name] = "fp32" if isinstance(arg, float) else "i32"
        signature.update({name: "constexpr" for name in constexprs})
        compiled = triton.compile(
            ASTSource(jitted, signature=signature, constexprs=values), target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps},
        )
        assert compiled.asm["cubin"] and f".entry {fn.__name__}" in compiled.asm["ptx"], fn.__name__


def test_the_block_size_sweep_keeps_every_settings_workspace(monkeypatch):
    """Each block-size setting solves in its own workspace (the sizes are in its key). The sweep times the
    settings interleaved, so a thread must keep them all while it runs: with the usual four, the first H100
    sweep's ten settings evicted each other and every timed solve recorded its graphs again."""
    import bench_selection  # tools/bench/bench_selection.py

    from composer_algos.selection import active_set_device as asd

    caps_seen = []
    real = bench_selection.time_interleaved
    monkeypatch.setattr(
        bench_selection, "time_interleaved", lambda *a: caps_seen.append(asd._WORKSPACES_PER_THREAD) or real(*a)
    )
    features, val, dom = make_instance(2, 40, dim=64, dtype=torch.float32)
    gram, mu, _ = build_objective(features, val, ETA)
    bench_selection.sweep_triton_blocks(gram, mu, dom, torch.tensor([6, 6, 6]), 12, repeats=1)
    assert caps_seen == [len(omp_triton.SWEEP) + 2], caps_seen  # the default and each setting, and one more
    assert asd._WORKSPACES_PER_THREAD == 4
