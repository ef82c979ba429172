"""`select_ahead: true`: select the next step's subset while the accelerator still runs this step's backward.

Composer 0.32 reads the device three times a batch (`iter_finished`, the batch size before the
forwards, the loss after the optimizer step), so when `AFTER_DATALOADER` fires the accelerator has
drained, and a selection started there spends its host time (launching the scoring pass, the
solve's reads) on an idle device. `AFTER_TRAIN_BATCH` fires after the step's forwards and backwards
are launched and before anything reads the device. A selection started there for the next pool
runs its host work while the device works through the backward; its kernels queue behind it.

`PeekableLoader` wraps the trainer's active dataloader and fetches the next batch early on request
(`peek`); the batch is then the one Composer's loop receives next, unchanged. `PendingSelection`
is the selection made ahead: the subset to train on, what the step logs, and a key of the pool
it was made for, checked against the batch that arrives. Composer's checkpoints count batches by
its own timestamp, so a pool fetched early is read again on resume; the pending selection rides
in the algorithm's state so that a resumed single-rank run trains on the same subset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PeekableLoader", "PendingSelection", "pool_key"]

_NOTHING = object()


class PeekableLoader:
    """An iterable over `loader` whose current iterator can hand out its next batch early.

    Each `iter()` starts a new pass over `loader` (Composer makes one per epoch). `peek()` fetches
    the next batch of the current pass (None at its end) and keeps it; the pass yields it next.
    `yielded_ahead` says whether the batch last yielded was fetched by `peek`. Attributes not
    defined here (`dataset`, `batch_size`, ...) are the wrapped loader's. `epoch`, when given, is
    called at each `iter()` to set a `DistributedSampler`'s epoch, which Composer does only for
    loaders that are `DataLoader`s.
    """

    def __init__(self, loader: Iterable, epoch: Callable[[], int] | None = None) -> None:
        self.loader = loader
        self.epoch = epoch
        self._it: Iterator | None = None
        self._ahead: Any = _NOTHING
        self.yielded_ahead = False

    def __iter__(self) -> Iterator:
        from torch.utils.data.distributed import DistributedSampler

        # Where Composer's trainer looks for one (its _get_distributed_sampler): the batch sampler, then the sampler.
        samplers = (getattr(self.loader, "batch_sampler", None), getattr(self.loader, "sampler", None))
        sampler = next((s for s in samplers if isinstance(s, DistributedSampler)), None)
        if self.epoch is not None and sampler is not None:
            sampler.set_epoch(int(self.epoch()))
        self._it, self._ahead, self.yielded_ahead = iter(self.loader), _NOTHING, False
        return self._pass(self._it)

    def _pass(self, it: Iterator) -> Iterator:
        while True:
            if self._it is not it:  # a newer pass started: this one is over
                return
            if self._ahead is not _NOTHING:
                batch, self._ahead, self.yielded_ahead = self._ahead, _NOTHING, True
            else:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self.yielded_ahead = False
            yield batch

    def peek(self) -> Any | None:
        """The batch the current pass yields next, fetched now (None when there is no pass or it has ended)."""
        if self._it is None:
            return None
        if self._ahead is _NOTHING:
            try:
                self._ahead = next(self._it)
            except StopIteration:
                return None
        return self._ahead

    def release(self) -> None:
        """Drop the current pass and any batch fetched early (at the end of a fit)."""
        self._it, self._ahead, self.yielded_ahead = None, _NOTHING, False

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError for an unsized loader, as Composer expects

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def pool_key(batch: Mapping[str, Any], domain_key: str) -> dict[str, torch.Tensor]:
    """What identifies a pool on the host: its domain ids and, when the batch has them, its sample ids."""
    key = {domain_key: batch[domain_key]}
    if isinstance(batch.get("sample_id"), torch.Tensor):
        key["sample_id"] = batch["sample_id"]
    return {k: v.detach().cpu() for k, v in key.items()}


@dataclass
class PendingSelection:
    """A selection made at one step's `AFTER_TRAIN_BATCH` for the next step's pool.

    Attributes:
        number: The batch index it is for.
        key: `pool_key` of the pool it was made from.
        batch: The subset to train on (what `state.batch` becomes).
        record: The keyword arguments of `record_step` for the step that trains on it.
        restored: Loaded from a checkpoint (the pool then comes from the loader, not from `peek`).
        before: The algorithm's state before making it (`DataSelection._ahead_state`), to undo what making it
            changed when it is not used; not checkpointed.
        pool: The pool batch it was made from (the object the loader hands on); not checkpointed.
    """

    number: int
    key: dict[str, torch.Tensor]
    batch: dict[str, Any]
    record: dict[str, Any]
    restored: bool = False
    before: dict[str, Any] | None = None
    pool: Any = None

    def matches(self, number: int, batch: Mapping[str, Any], domain_key: str) -> bool:
        """Whether `batch`, arriving at step `number`, is the pool this selection was made from."""
        if number != self.number:
            return False
        key = pool_key(batch, domain_key)
        return key.keys() == self.key.keys() and all(torch.equal(key[k], self.key[k]) for k in key)

    def state_dict(self) -> dict[str, Any]:
        """Host copies of everything (one read of the device at checkpoint time)."""
        from composer.devices import DeviceCPU

        host = DeviceCPU().batch_to_device  # every tensor in nested mappings and sequences, the rest as it is
        return {"number": self.number, "key": self.key, "batch": host(self.batch), "record": host(self.record)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PendingSelection:
        return cls(int(state["number"]), dict(state["key"]), dict(state["batch"]), dict(state["record"]), restored=True)

