"""What one selection step costs an accelerator, counted on any machine: host syncs and aten ops.

A GPU step is bound by the host when it launches many small kernels or waits on the device. Both
are deterministic counts a CPU run can take, so `tools/bench/bench_step.py` prints them beside its
ratios and `tests/training/test_step_syncs.py` bounds them:

- **aten ops** (`OpCount`, a `TorchDispatchMode`): every aten op the step dispatches below
  autograd (forward, `autograd.grad`'s backward, products, solver), and of them the kernel
  launches (`kernels`): ops that are not views (nor allocations, dtype queries or profiler marks)
  and that run on the device (on a CPU run, as the emulation below places them).
- **host syncs** (`SyncAudit`, a `TorchFunctionMode`): the calls made by the project's own code
  (`composer_algos/`, `pipeline/`, `train.py`: the innermost frame outside torch) that would make
  the host wait for the GPU. On CUDA `StepAuditor` reads them from torch itself
  (`torch.cuda.set_sync_debug_mode`); on a CPU run every tensor is on the host, so the audit
  EMULATES which tensors a CUDA run would hold on the device and flags the calls that would sync:

  device-resident: the model's parameters and buffers, the optimizer's state (its 0-dim `step`
  only where the optimizer keeps it on the device: Composer's DecoupledAdamW, torch's fused or
  capturable Adam/AdamW), everything computed from a device-resident tensor, tensors a factory
  creates with an explicit `device=` (`torch.zeros(n, device=d)`; not a draw from a `generator=`,
  which the project makes on the host, and not the string "cpu"), and a host tensor moved with
  `.to(device)`. Host: the loader's batch, Python data, generator draws, `.cpu()` results.
  A `torch.device` read from a tensor (`x.device`) keeps that tensor's side, so `y.to(x.device)`
  moves y to x's side.

  Flagged (each a `sync` unless said otherwise): reading a device tensor on the host (`item`,
  `tolist`, `numpy`, `bool`/`int`/`float`/`index` of it, formatting it), moving it to the host
  (`.cpu()`, `.to("cpu")`, `.to(host_tensor.device)`, `copy_` into a host tensor); ops whose
  output size depends on device data (`nonzero`, `argwhere`, `masked_select`, `unique`,
  `unique_consecutive`, `bincount` (CUDA's reads the max), `histc`, `repeat_interleave` without
  `output_size`, one-argument `where`, indexing with a bool tensor, assigning a Python number or a
  0-dim host tensor through an integer index tensor, `x[idx] = 0`) and ops that check values on
  the host (`equal`, `allclose`, `linalg.cholesky`/`inv`/`solve`/`eigh` without `_ex`,
  `multinomial`); `h2d`: a blocking copy of host data to the device (`.to(device)` without
  `non_blocking=True`, `torch.tensor(data, device=d)`, `new_tensor`, indexing a device tensor
  with a host index tensor); `mixed`: an op given device tensors and host tensors of one or more
  dimensions (an error on CUDA).

The emulation follows the project's conventions (a host move is spelled `.cpu()`; a factory that
means the host passes no device), and `StepAuditor` on CUDA is the ground truth it models.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[2]
PROJECT_ROOTS = (str(REPO / "composer_algos") + os.sep, str(REPO / "pipeline") + os.sep, str(REPO / "train.py"))
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_HERE = str(Path(__file__).resolve())

__all__ = [
    "OpCount", "StepAuditor", "StepCounts", "SyncAudit", "cuda_sync_count", "device_busy_intervals", "device_tensors_of", "device_work",
    "format_counts", "first_read", "format_op_sites", "op_site",
]

# Reading a device tensor's value on the host.
_HOST_READS = {
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__format__",
    "__repr__", "__str__", "__array__",
}
# Ops whose output shape or whose checks need device values on the host.
_DATA_DEPENDENT = {
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique2", "bincount", "histc",
    "equal", "allclose", "cholesky", "inverse", "inv", "solve", "eigh", "multinomial", "nonzero_static_",
}
# torch.linalg functions that check their results on the host (the `_ex` forms do not).
_LINALG_CHECKED = {"cholesky", "inv", "solve", "eigh", "eigvalsh", "lstsq"}
# Factories of new tensors: where the result lives is the `device=` argument's side (host without one).
_FACTORIES = {
    "zeros", "ones", "full", "empty", "arange", "eye", "linspace", "logspace", "rand", "randn", "randint",
    "randperm", "empty_strided", "tensor", "as_tensor", "asarray", "from_numpy", "scalar_tensor", "range",
}
# Factories that copy Python/host data (a blocking host-to-device copy when the device is an accelerator).
_COPYING_FACTORIES = {"tensor", "as_tensor", "asarray"}
# Tensor methods and functions that make a tensor like their first argument (its side, unless `device=`).
_LIKE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
         "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided"}
# Calls that neither compute nor move data: no event, no mixing check.
_METADATA = {"__get__", "size", "dim", "numel", "__len__", "is_floating_point", "is_complex", "element_size",
             "stride", "storage_offset", "is_contiguous", "data_ptr", "__hash__", "__eq__hash", "register_hook",
             "requires_grad_", "retain_grad", "untyped_storage", "_version", "__setstate__", "__reduce_ex__",
             "get_device", "__deepcopy__", "__torch_function__"}


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property (getset descriptor): its own name
        owner = getattr(func, "__self__", None)
        return "." + str(getattr(owner, "__name__", "__get__"))
    return name


_WARNINGS_FILE = warnings.__file__


def _call_site(limit: int = 60) -> tuple[str, bool]:
    """`(file:line function, whether it is project code)` of the innermost frame outside torch and this file."""
    frame = sys._getframe(2)
    for _ in range(limit):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and filename not in (_HERE, _WARNINGS_FILE):
            project = filename.startswith(PROJECT_ROOTS)
            where = os.path.relpath(filename, REPO) if project else filename.rsplit("site-packages/", 1)[-1]
            return f"{where}:{frame.f_lineno} {frame.f_code.co_name}", project
        frame = frame.f_back
    return "?", False


_MODEL_CODE = os.sep + "transformers" + os.sep + "models" + os.sep


def op_site(limit: int = 80) -> str:
    """`file function` of the innermost frame in the project's code or in a transformers model file ("other" else).

    What `OpCount(attribute=True)` files an op under: the model's own forward (`modeling_llama.py
    forward`, `apply_rotary_pos_emb`, ...) apart from the project's features, solver and step code.
    A backward is filed under the project frame that called `autograd.grad`.
    """
    frame = sys._getframe(2)
    for _ in range(limit):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if filename.startswith(PROJECT_ROOTS) or _MODEL_CODE in filename:
            return f"{os.path.basename(filename)} {frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


def format_op_sites(by_site: dict[str, list[int]], top: int) -> str:
    """The `top` sites by aten ops: ops, kernel launches, site; then the model's share of the total."""
    total = sum(v[0] for v in by_site.values()) or 1
    model = sum(v[0] for k, v in by_site.items() if k.startswith("modeling_"))
    lines = [f"{'ops':>7}{'launches':>10}  site (innermost project or transformers model frame)"]
    for site, (ops, kernels) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{ops:>7}{kernels:>10}  {site}")
    lines.append(f"the model's own code (modeling_*.py): {model} of {total} ops ({100 * model / total:.0f}%)")
    return "\n".join(lines)


class SyncAudit(TorchFunctionMode):
    """Emulated host syncs of the project's code on a CPU run (module docstring for the rules).

    Args:
        device_tensors: tensors a CUDA run holds on the device (`device_tensors_of`).
        pause: called with True/False around the audit's own tensor copies (so an `OpCount`
            running at the same time does not count them).

    Attributes:
        events: Counter of `(kind, site, call)`; kind `sync`, `h2d` or `mixed`.
        other: the same for calls made outside the project's code (transformers, Composer).
        timeline: the project's syncs in order, each `(ops, launches, kind, site, call)` with the aten ops and
            launches dispatched before it, when `clock` (set by `StepAuditor`) gives those counts.
    """

    def __init__(self, device_tensors: Iterable[torch.Tensor] = (), pause: Callable[[bool], None] | None = None) -> None:
        super().__init__()
        self._dev: dict[int, weakref.ref] = {}
        self._devices: dict[int, tuple[Any, bool]] = {}  # id(torch.device) -> (device, on the device side)
        self._pause = pause or (lambda flag: None)
        # Whether the call being run computes on the device (read by OpCount for each aten op).
        self.device_call = False
        self.events: collections.Counter = collections.Counter()
        self.other: collections.Counter = collections.Counter()
        self.timeline: list[tuple[int, int, str, str, str]] = []
        self.clock: Callable[[], tuple[int, int]] | None = None
        for t in device_tensors:
            self._mark(t)

    # ---------------------------------------------------------------- residency
    def _mark(self, t: torch.Tensor) -> None:
        self._dev[id(t)] = weakref.ref(t)

    def on_device(self, t: torch.Tensor) -> bool:
        ref = self._dev.get(id(t))
        return ref is not None and ref() is t

    def _side_of_device(self, device: Any) -> bool | None:
        """True: the accelerator; False: the host; None: no device given."""
        if device is None:
            return None
        if isinstance(device, torch.Tensor):
            return self.on_device(device)
        known = self._devices.get(id(device))
        if known is not None and known[0] is device:
            return known[1]
        if isinstance(device, str):
            return not device.startswith("cpu")
        if isinstance(device, int):
            return True
        return True  # a torch.device of unknown origin: the run's accelerator (module docstring)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        self._pause(True)
        try:
            return t.detach().clone()
        finally:
            self._pause(False)

    # ---------------------------------------------------------------- the hook
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        dev_in = [self.on_device(t) for t in tensors]
        kind, result_side = self._classify(name, func, args, kwargs, tensors, dev_in)
        outer, self.device_call = self.device_call, bool(any(dev_in) if result_side is None else result_side)
        before = self.clock() if kind in ("sync", "h2d") and self.clock is not None else None
        try:
            out = func(*args, **kwargs)
        finally:
            self.device_call = outer
        if kind is not None:
            site, project = _call_site()
            # Outside the project a "mixed" call is this emulation's blind spot (a tensor made
            # inside torch.vmap, as transformers' masks are, is not seen being made), not a finding.
            if project or kind != "mixed":
                (self.events if project else self.other)[(kind, site, name)] += 1
            if project and before is not None:
                self.timeline.append((*before, kind, site, name))
        return self._settle(name, args, out, any(dev_in), result_side)

    def _classify(self, name, func, args, kwargs, tensors, dev_in) -> tuple[str | None, bool | None]:
        """`(event kind or None, forced side of the result or None)`."""
        if name == ".device" or name in _METADATA or name.startswith("."):
            return None, None
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self_dev = self_t is not None and self.on_device(self_t)
        if name in _HOST_READS:
            return ("sync" if self_dev else None), False
        if name == "cpu":
            return ("sync" if self_dev else None), False
        if name in ("to", "cuda"):
            return self._classify_move(name, args, kwargs, self_t, self_dev)
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst_dev, src_dev = self_dev, self.on_device(args[1])
            if src_dev and not dst_dev:
                return "sync", None
            if dst_dev and not src_dev and args[1].dim() > 0 and not kwargs.get("non_blocking", False):
                return "h2d", None
            return None, None
        module = getattr(func, "__module__", "") or ""
        if name in _FACTORIES and self_t is None:
            if kwargs.get("generator") is not None:
                return None, False
            side = self._side_of_device(kwargs.get("device"))
            if name in _COPYING_FACTORIES and side and not (args and isinstance(args[0], torch.Tensor) and self.on_device(args[0])):
                return "h2d", True
            if side is None and name in _COPYING_FACTORIES and args and isinstance(args[0], torch.Tensor):
                return None, self.on_device(args[0])
            return None, bool(side)
        if name in _LIKE or name == "new_tensor":
            side = self._side_of_device(kwargs.get("device"))
            side = self_dev if side is None else side
            if name == "new_tensor" and side:
                return "h2d", True
            return None, side
        if name in _LINALG_CHECKED and "linalg" in module and any(dev_in):
            return "sync", None
        if name in _DATA_DEPENDENT and any(dev_in):
            return "sync", None
        if name == "repeat_interleave" and any(dev_in) and kwargs.get("output_size") is None:
            if len(args) > 1 and isinstance(args[1], torch.Tensor) or isinstance(kwargs.get("repeats"), torch.Tensor) or len(args) == 1:
                return "sync", None
        if name == "where" and len(args) == 1 and any(dev_in):
            return "sync", None
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put", "index"):
            return self._classify_index(name, args, self_dev), None
        # Host tensors of one or more dimensions beside device tensors: an error on CUDA (a 0-dim
        # host tensor is a scalar there).
        if any(dev_in) and any(t.dim() > 0 for t, d in zip(tensors, dev_in) if not d):
            return "mixed", None
        return None, None

    def _classify_move(self, name, args, kwargs, self_t, self_dev) -> tuple[str | None, bool | None]:
        target = kwargs.get("device")
        if name == "cuda":
            target = "cuda"
        rest = list(args[1:])
        for a in rest:
            if isinstance(a, (torch.device, str, int)) or isinstance(a, torch.Tensor):
                target = a
                break
        non_blocking = bool(kwargs.get("non_blocking", False)) or any(a is True for a in rest[1:])
        side = self._side_of_device(target)
        if side is None or self_t is None:
            return None, None
        if self_dev and not side:
            return "sync", False
        if not self_dev and side:
            return (None if non_blocking else "h2d"), True
        return None, side

    def _classify_index(self, name, args, self_dev) -> str | None:
        index = args[1] if len(args) > 1 else None
        idx_leaves, _ = tree_flatten(index)
        idx_tensors = [x for x in idx_leaves if isinstance(x, torch.Tensor)]
        if name == "__setitem__" and len(args) > 2 and isinstance(args[2], torch.Tensor):
            value = args[2]
            if self.on_device(value) and not self_dev and value.dim() > 0:
                return "mixed"
        masks = any(t.dtype in (torch.bool, torch.uint8) for t in idx_tensors)
        if name == "__setitem__" and self_dev and idx_tensors and not masks and len(args) > 2:
            value = args[2]
            if isinstance(value, torch.Tensor) and not self.on_device(value) and value.dim() > 0:
                return "mixed"  # a host tensor of values into a device tensor: an error on CUDA
            if isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and not self.on_device(value)):
                # `x[index_tensor] = 0`: the value becomes a 0-dim host tensor that index_put_ copies to
                # the device from pageable memory, a sync (torch 2.11 on an H200, set_sync_debug_mode);
                # `index_fill_` takes the scalar as a kernel argument instead. (A bool mask index is
                # the mask rule's below.)
                return "sync"
        for t in idx_tensors:
            t_dev = self.on_device(t)
            if t.dtype in (torch.bool, torch.uint8) and (t_dev or self_dev):
                return "sync"  # a mask index is a nonzero
            if self_dev and not t_dev and t.dim() > 0:
                return "h2d"  # a host index tensor is copied to the device
            if t_dev and not self_dev:
                return "mixed"
        return None

    def _settle(self, name, args, out, any_dev_in: bool, result_side: bool | None):
        """Mark the result's side; a host copy of a device tensor becomes a distinct (host) tensor."""
        if name == ".device":
            if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.device):
                self._devices[id(out)] = (out, self.on_device(args[0]))
            return out
        if name in _HOST_READS:
            return out
        side = any_dev_in if result_side is None else result_side
        if isinstance(out, torch.Tensor):
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if out is src and side != self.on_device(src):
                # A move that is a no-op on this machine: a distinct tensor keeps the source on its side.
                out = self._copy(out)
            if side:
                self._mark(out)
            return out
        if side:
            leaves, _ = tree_flatten(out)
            for t in leaves:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out

    def counts(self) -> dict[str, int]:
        out = {"sync": 0, "h2d": 0, "mixed": 0}
        for (kind, _site, _call), n in self.events.items():
            out[kind] += n
        return out


# Ops that launch no kernel: views in all but name, dtype queries, allocations, profiler marks.
_NO_KERNEL = {
    "aten._unsafe_view", "aten.promote_types", "aten.empty", "aten.empty_strided", "aten.empty_like",
    "aten.lift_fresh", "aten.detach", "aten.alias", "aten._local_scalar_dense", "aten.result_type",
}


class OpCount(TorchDispatchMode):
    """Count the aten ops dispatched below autograd (`ops`) and the kernel launches among them (`kernels`).

    A kernel is an op that is not a view (nor a view in all but name, an allocation or a profiler
    mark) and that runs on the accelerator: on CUDA an op with a CUDA tensor; on a CPU run, with
    `on_device`, an op inside a call the emulation puts on the device (`SyncAudit.device_call`),
    so the host's own work (the loader's batch, capacities, generator draws) is not counted.
    """

    def __init__(self, on_device: Callable[[], bool] | None = None, *, attribute: bool = False) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.by_name: collections.Counter = collections.Counter()
        # With `attribute`: `[ops, kernels]` per `op_site()` (who dispatched them: the project, or which model).
        self.by_site: dict[str, list[int]] | None = collections.defaultdict(lambda: [0, 0]) if attribute else None
        self.paused = False
        self.on_device = on_device

    def pause(self, flag: bool) -> None:
        self.paused = flag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.ops += 1
            kernel = False
            name = str(func.overloadpacket)
            if not func.is_view and name not in _NO_KERNEL and not name.startswith("profiler."):
                if self.on_device is not None:
                    kernel = self.on_device()
                else:
                    leaves, _ = tree_flatten((args, kwargs, out))
                    kernel = any(isinstance(t, torch.Tensor) and t.is_cuda for t in leaves)
                if kernel:
                    self.kernels += 1
                    self.by_name[name] += 1
            if self.by_site is not None:
                counts = self.by_site[op_site()]
                counts[0] += 1
                counts[1] += kernel
        return out


def cuda_sync_count(fn: Callable[[], Any]) -> int:
    """Host syncs torch itself reports (`torch.cuda.set_sync_debug_mode("warn")`) during one call of `fn` on CUDA."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def device_tensors_of(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> list[torch.Tensor]:
    """The tensors a CUDA run holds on the device before a step: parameters, buffers, optimizer state."""
    out = list(model.parameters()) + list(model.buffers())
    for opt in optimizers:
        on_device_step = type(opt).__name__ == "DecoupledAdamW" or any(
            g.get("fused") or g.get("capturable") for g in opt.param_groups
        )
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (value.dim() > 0 or key != "step" or on_device_step):
                    out.append(value)
    return out


class StepCounts(dict):
    """`ops` (aten ops), `kernels` (launches among them), `sync`, `h2d`, `mixed` of one step, with `sites` and `how`
    (and `op_sites`, `[ops, kernels]` per `op_site`, when the auditor attributes ops), and `timeline`: the
    project's syncs in order, each `(ops, launches, kind, site, call)` with what was dispatched before it. The
    host work before the first read can overlap the GPU's earlier work; what follows it waits for the GPU."""


class StepAuditor:
    """Counts a trainer's selection steps (`DataSelection` at AFTER_DATALOADER): `count()` steps one batch.

    Attach it before the run's first step and keep it attached until the counted one: on a CPU run
    the emulation must see every selection step, so that what the steps cache (projections, sketch
    matrices, running averages) is known to live on the device. Detach (`close`) before timing: the
    audit slows the steps it watches. On CUDA the uncounted steps run as they are.
    """

    def __init__(self, trainer, *, attribute_ops: bool = False) -> None:
        from composer.core import Event

        from composer_algos.data_selection.algorithm import find_data_selection

        self.trainer = trainer
        self.attribute_ops = attribute_ops
        self.cuda = any(p.is_cuda for p in trainer.state.model.parameters())
        self._ops: OpCount | None = None
        self._audit = SyncAudit(pause=self._pause) if not self.cuda else None
        self._counting = False
        self._cuda_events: collections.Counter = collections.Counter()
        self._cuda_other: collections.Counter = collections.Counter()
        self._cuda_timeline: list[tuple[int, int, str, str, str]] = []
        algo = find_data_selection(trainer.state)
        if algo is None:
            raise ValueError("the trainer has no DataSelection algorithm")
        self._algo = algo
        self._original = algo.apply

        def apply(event, state, logger):
            if event != Event.AFTER_DATALOADER:
                return self._original(event, state, logger)
            return self._run(lambda: self._original(event, state, logger))

        algo.apply = apply  # type: ignore[method-assign]

    def _pause(self, flag: bool) -> None:
        if self._ops is not None:
            self._ops.pause(flag)

    def _run(self, call: Callable[[], Any]) -> Any:
        state = self.trainer.state
        if self._audit is not None:
            for t in device_tensors_of(state.model, state.optimizers):
                self._audit._mark(t)
        stack = contextlib.ExitStack()
        with stack:
            if self._counting:
                audit = self._audit
                self._ops = OpCount(
                    on_device=(lambda: audit.device_call) if audit is not None else None, attribute=self.attribute_ops
                )
                stack.enter_context(self._ops)
                if self._audit is not None:
                    self._audit.events.clear()
                    self._audit.other.clear()
                    self._audit.timeline.clear()
                    ops = self._ops
                    self._audit.clock = lambda: (ops.ops, ops.kernels)
                else:
                    # torch warns inside the op that syncs: the Python stack then shows who called it.
                    stack.enter_context(warnings.catch_warnings())
                    warnings.simplefilter("always")
                    self._cuda_events, self._cuda_other = collections.Counter(), collections.Counter()
                    self._cuda_timeline = []
                    show = warnings.showwarning

                    def record(message, category, filename, lineno, file=None, line=None):
                        if "synchroniz" not in str(message):
                            return show(message, category, filename, lineno, file, line)
                        site, project = _call_site()
                        (self._cuda_events if project else self._cuda_other)[("sync", site, "cuda")] += 1
                        if project and self._ops is not None:
                            self._cuda_timeline.append((self._ops.ops, self._ops.kernels, "sync", site, "cuda"))

                    warnings.showwarning = record
                    torch.cuda.set_sync_debug_mode("warn")
                    stack.callback(torch.cuda.set_sync_debug_mode, "default")
            if self._audit is not None:
                stack.enter_context(self._audit)
            return call()

    def count(self) -> StepCounts:
        """Step the trainer one batch (`fit(duration="1ba")`), counting its selection step."""
        self._counting = True
        try:
            self.trainer.fit(duration="1ba")
        finally:
            self._counting = False
        ops = self._ops
        assert ops is not None, "the batch ran no selection step"
        if self._audit is not None:
            events, other, how = collections.Counter(self._audit.events), collections.Counter(self._audit.other), "emulated"
            timeline = list(self._audit.timeline)
            self._audit.clock = None
        else:
            events, other, how, timeline = self._cuda_events, self._cuda_other, "cuda", self._cuda_timeline
        counts = StepCounts(ops=ops.ops, kernels=ops.kernels, sync=0, h2d=0, mixed=0)
        for (kind, _site, _call), n in events.items():
            counts[kind] += n
        counts.update(
            sites=events, other=other, by_name=ops.by_name, how=how, op_sites=dict(ops.by_site or {}), timeline=timeline
        )
        self._ops = None
        return counts

    def close(self) -> None:
        """Detach from the trainer (its selection steps run unwatched again)."""
        self._algo.apply = self._original  # type: ignore[method-assign]


def format_counts(counts: StepCounts, top: int = 12) -> str:
    """A few lines: the totals, then the call sites of the syncs."""
    lines = [
        f"aten ops {counts['ops']} ({counts['kernels']} kernel launches); host syncs {counts['sync'] + counts['h2d']} "
        f"({counts['sync']} reads, {counts['h2d']} blocking copies to the device; {counts['how']})"
        + (f"; {counts['mixed']} device-mixing calls" if counts.get("mixed") else "")
    ]
    for (kind, site, call), n in counts["sites"].most_common(top):
        lines.append(f"  {n:4d} {kind:5} {call:18} {site}")
    first = first_read(counts)
    if first:
        lines.append("  " + first)
    return "\n".join(lines)


def first_read(counts: StepCounts) -> str:
    """Where the step's first host read falls ("" without one): the host work before it can overlap the GPU's
    earlier work, the rest waits for the GPU."""
    timeline = counts.get("timeline") or []
    if not timeline:
        return ""
    ops, kernels, kind, site, call = timeline[0]
    return (
        f"first host read after {ops} of {counts['ops']} aten ops ({kernels} of {counts['kernels']} launches):"
        f" {kind} {call} {site}"
    )


def device_work(events) -> list:
    """The device events that are work (kernels, copies, memsets), not `record_function` ranges mirrored on the device."""
    return [e for e in events if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)]


def device_busy_intervals(events) -> list[tuple[float, float]]:
    """The union of `device_work(events)`'s time ranges, as disjoint (start, end) intervals in order."""
    merged: list[list[float]] = []
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in device_work(events)):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]
