"""The DoReMi proxy-training Composer algorithm: Group DRO domain weights against a frozen reference."""

# Shapes: B examples, T tokens per example (T-1 after the causal shift), V vocabulary, C domains.

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from composer.core import Algorithm, Event, State
from composer.core.precision import get_precision_context
from composer.loggers import Logger
from composer.utils import dist

from composer_algos.doremi.callback import DoReMiMixtureWriter
from composer_algos.doremi.core import (
    clipped_excess_sums,
    domain_sums,
    domain_token_counts,
    doremi_update,
    excess_per_domain,
    per_token_losses,
    resolve_initial_weights,
    weighted_domain_loss,
)
from composer_algos.doremi.reference import freeze_reference, load_reference_model

log = logging.getLogger(__name__)

__all__ = ["DoReMi"]

_MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


class DoReMi(Algorithm):
    """Train a DoReMi proxy: domain weights by Group DRO on the excess loss over a reference.

    Xie et al., "DoReMi: Optimizing Data Mixtures Speeds Up Language Model Pretraining"
    (NeurIPS 2023, https://arxiv.org/abs/2305.10429), Algorithm 1. Each step t:

    1. `lambda_t[c]` = mean over the step's target tokens of domain c (all ranks) of
       `max(0, l_proxy - l_ref)`, with the proxy's losses at the current parameters and the
       reference's computed under `torch.no_grad` in eval mode. A domain with no tokens in the
       step keeps its last score (0 before it is first seen).
    2. `alpha_t = (1 - smoothing) * softmax(log alpha_{t-1} + eta_dro * lambda_t) + smoothing / C`.
    3. The proxy trains on `sum_c alpha_t[c] * (sum of its domain-c token losses) / N_c`
       (N_c: domain c's target tokens in the step, all ranks), which replaces `state.loss`.

    This is DoReMi's ordering: the excess comes from this step's forward and the loss is weighted
    by the weights it produces. When the device batch is one microbatch (the usual case), the
    excess is read from the training forward itself, so the only extra cost is one reference
    forward. When it is split into several microbatches, the first backward already needs
    `alpha_t`, so at `AFTER_DATALOADER` the proxy runs one extra no-grad forward in eval mode
    over the whole device batch (in microbatch-sized chunks); with dropout > 0 this excess
    differs from the single-microbatch one by the dropout noise only.

    The output mixture is the mean of `alpha_0, ..., alpha_T` (initial weights included); see
    `averaged_weights`. The `DoReMiMixtureWriter` callback (attached automatically unless one is
    configured) logs `doremi/weight/<domain>` and `doremi/excess/<domain>` and writes
    `mixture.json` and `mixture_steps.csv`.

    Events: `INIT` (attaches the writer), `FIT_START` (loads and freezes the reference),
    `AFTER_DATALOADER` (token counts, all-reduced; excess for microbatched steps), `AFTER_LOSS`
    (excess and weight update for single-microbatch steps; replaces the loss), `BATCH_END`
    (commits the step's weights). Gradient accumulation assumes Composer's default of
    accumulating by samples (`accumulate_train_batch_on_tokens=False`) or by the default token
    count (B*T); `device_train_microbatch_size='auto'` is not supported.

    Args:
        reference: The reference model: a Hugging Face directory, a Composer checkpoint `.pt` of
            the reference run, or a module (see `load_reference_model`).
        domain_names: Domain names in domain-id order (train.py passes the manifest's).
        eta_dro: Step size of the exponentiated-gradient update (default 1.0).
        smoothing: Uniform smoothing `c` of the weights (default 1e-3).
        initial_weights: "uniform" (default), "natural" (needs `natural_weights`) or a mapping
            from every domain name to a positive weight.
        natural_weights: Natural shares of the training data in `domain_names` order; required
            by `initial_weights="natural"` and written into `mixture.json` when given.
        run_dir: The run's directory (train.py fills in the save folder or runs/<run_name>);
            `{run_name}` is replaced. The writer puts `mixture.json` and `mixture_steps.csv` in
            `<run_dir>/doremi/`, apart from the `MixtureMonitor` files of the proxy run itself
            (which record the mixture the proxy was fed, not the learned one).
        reference_base_model: Base model (Hugging Face name or directory) for a reference
            checkpoint that holds only LoRA weights.

    Raises:
        ValueError: On invalid arguments (the message names the argument).
    """

    def __init__(
        self,
        reference: str | os.PathLike | torch.nn.Module,
        domain_names: list[str],
        eta_dro: float = 1.0,
        smoothing: float = 1e-3,
        initial_weights: str | Mapping[str, float] = "uniform",
        natural_weights: Sequence[float] | None = None,
        run_dir: str = "runs/{run_name}",
        reference_base_model: str | None = None,
    ) -> None:
        names = [str(n) for n in domain_names]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"`domain_names` must be non-empty and unique, got {names}")
        if not eta_dro > 0:
            raise ValueError(f"`eta_dro` must be > 0, got {eta_dro}")
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"`smoothing` must be in [0, 1], got {smoothing}")
        if natural_weights is not None and len(natural_weights) != len(names):
            raise ValueError(f"`natural_weights` has {len(natural_weights)} values for {len(names)} domains {names}")
        self.reference = reference
        self.reference_base_model = reference_base_model
        self.domain_names = names
        self.eta_dro = float(eta_dro)
        self.smoothing = float(smoothing)
        self.run_dir = run_dir
        self.natural_weights = None
        if natural_weights is not None:
            nat = [float(x) for x in natural_weights]
            if not all(x >= 0 for x in nat) or sum(nat) <= 0:
                raise ValueError(f"`natural_weights` must be >= 0 with a positive sum, got {nat}")
            self.natural_weights = [x / sum(nat) for x in nat]
        self.initial_alpha_C = resolve_initial_weights(initial_weights, names, natural_weights)
        # Running state (float64: the average runs over up to ~1e5 steps). Kept on the proxy's
        # device from FIT_START on; `state_dict` moves copies to CPU.
        self.alpha_C = self.initial_alpha_C.clone()
        self.last_lam_C = torch.zeros_like(self.alpha_C)
        self.alpha_sum_C = self.initial_alpha_C.clone()
        self.num_updates = 0
        self._ref: torch.nn.Module | None = None
        self._step: dict[str, Any] | None = None
        self._checked_batch = False

    @property
    def num_domains(self) -> int:
        return len(self.domain_names)

    def averaged_weights(self) -> torch.Tensor:
        """The output mixture: the mean of the initial and every committed step's weights, (C,)."""
        return self.alpha_sum_C / (self.num_updates + 1)

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.AFTER_DATALOADER, Event.AFTER_LOSS, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._attach_writer(state)
        elif event == Event.FIT_START:
            self._fit_start(state)
        elif event == Event.AFTER_DATALOADER:
            self._after_dataloader(state)
        elif event == Event.AFTER_LOSS:
            self._after_loss(state)
        elif event == Event.BATCH_END:
            self._commit_step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "domain_names": list(self.domain_names),
            "alpha": self.alpha_C.detach().cpu().clone(),
            "last_lambda": self.last_lam_C.detach().cpu().clone(),
            "alpha_sum": self.alpha_sum_C.detach().cpu().clone(),
            "initial_alpha": self.initial_alpha_C.detach().cpu().clone(),
            "num_updates": int(self.num_updates),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["domain_names"]) != self.domain_names:
            raise ValueError(
                f"cannot resume DoReMi: the checkpoint's domains {state['domain_names']} differ from "
                f"this run's {self.domain_names}"
            )
        device = self.alpha_C.device
        self.alpha_C = state["alpha"].to(device, torch.float64)
        self.last_lam_C = state["last_lambda"].to(device, torch.float64)
        self.alpha_sum_C = state["alpha_sum"].to(device, torch.float64)
        self.initial_alpha_C = state["initial_alpha"].to(torch.float64)
        self.num_updates = int(state["num_updates"])
        self._step = None

    # ---- events -------------------------------------------------------------------------------

    def _attach_writer(self, state: State) -> None:
        if not any(isinstance(cb, DoReMiMixtureWriter) for cb in state.callbacks):
            state.callbacks.append(DoReMiMixtureWriter())

    def _fit_start(self, state: State) -> None:
        if state.auto_microbatching:
            raise ValueError(
                "DoReMi does not support device_train_microbatch_size='auto' (a retried batch would need "
                "its excess recomputed at another microbatch size); set an integer"
            )
        device = _model_device(state.model)
        if self._ref is None:
            ref = load_reference_model(self.reference, base_model=self.reference_base_model)
            proxy_params = {id(p) for p in state.model.parameters()}
            if any(id(p) in proxy_params for p in ref.parameters()):
                raise ValueError("DoReMi `reference` shares parameters with the proxy; give a separate model")
            self._ref = freeze_reference(ref, device)
        self.alpha_C = self.alpha_C.to(device)
        self.last_lam_C = self.last_lam_C.to(device)
        self.alpha_sum_C = self.alpha_sum_C.to(device)

    def _after_dataloader(self, state: State) -> None:
        batch = state.batch
        self._check_batch(batch)
        device = self.alpha_C.device
        labels_BT = batch["labels"].to(device, non_blocking=True)
        domain_id_B = batch["domain_id"].to(device, non_blocking=True)
        num_rows = labels_BT.shape[0]
        mb_size = state.device_train_microbatch_size
        split = isinstance(mb_size, int) and num_rows > mb_size
        # One all-reduce: per-domain token counts, this rank's rows, whether any rank splits.
        stats = torch.cat([
            domain_token_counts(labels_BT, domain_id_B, self.num_domains),
            torch.tensor([float(num_rows), float(split)], dtype=torch.float64, device=device),
        ])
        dist.all_reduce(stats, reduce_operation="SUM")
        count_C = stats[: self.num_domains]
        world_size = dist.get_world_size()
        self._step = {
            "count_C": count_C,
            "mean_rows": stats[self.num_domains] / world_size,
            "world_size": world_size,
            "alpha_C": None,
            "lam_C": None,
        }
        # One host sync per step decides the path identically on every rank.
        if bool(stats[self.num_domains + 1].item() > 0):
            assert isinstance(mb_size, int)
            excess_sum_C = torch.zeros(self.num_domains, dtype=torch.float64, device=device)
            for start in range(0, num_rows, mb_size):
                chunk = {k: v[start : start + mb_size] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                chunk = state.device.batch_to_device(chunk)
                proxy_BT1, mask_BT1 = self._proxy_eval_losses(state, chunk)
                ref_BT1 = self._reference_losses(state, chunk)
                excess_sum_C += clipped_excess_sums(proxy_BT1, ref_BT1, mask_BT1, chunk["domain_id"], self.num_domains)
            self._finish_update(excess_sum_C)

    def _after_loss(self, state: State) -> None:
        if self._step is None:
            raise RuntimeError("DoReMi: AFTER_LOSS without AFTER_DATALOADER (is the algorithm registered twice?)")
        batch = state.batch
        logits_BTV = _logits(state.outputs)
        loss_BT1, mask_BT1 = per_token_losses(logits_BTV, batch["labels"])
        domain_id_B = batch["domain_id"]
        if self._step["alpha_C"] is None:
            # Single-microbatch step: the excess comes from this forward.
            ref_BT1 = self._reference_losses(state, batch)
            self._finish_update(clipped_excess_sums(loss_BT1, ref_BT1, mask_BT1, domain_id_B, self.num_domains))
        loss_sum_C = domain_sums(loss_BT1 * mask_BT1, domain_id_B, self.num_domains)
        loss = weighted_domain_loss(loss_sum_C, self._step["count_C"], self._step["alpha_C"])
        # Composer multiplies a microbatch's loss by rows_k / mean_rows and DDP averages gradients
        # over ranks; undo both so that the summed, averaged gradient is that of the global loss.
        rows = domain_id_B.shape[0]
        scale = self._step["world_size"] * self._step["mean_rows"] / rows
        state.loss = loss * scale.to(loss.dtype)

    def _commit_step(self) -> None:
        if self._step is None or self._step["alpha_C"] is None:
            return
        self.alpha_C = self._step["alpha_C"]
        self.last_lam_C = self._step["lam_C"]
        self.alpha_sum_C = self.alpha_sum_C + self.alpha_C
        self.num_updates += 1
        self._step = None

    # ---- helpers ------------------------------------------------------------------------------

    def _finish_update(self, excess_sum_C: torch.Tensor) -> None:
        """All-reduce the excess sums and compute this step's scores and weights (idempotent)."""
        assert self._step is not None
        dist.all_reduce(excess_sum_C, reduce_operation="SUM")
        lam_C = excess_per_domain(excess_sum_C, self._step["count_C"], self.last_lam_C)
        self._step["lam_C"] = lam_C
        # From the committed alpha_{t-1}, so a retried step gives the same alpha_t.
        self._step["alpha_C"] = doremi_update(self.alpha_C, lam_C, eta_dro=self.eta_dro, smoothing=self.smoothing)

    @torch.no_grad()
    def _reference_losses(self, state: State, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        assert self._ref is not None
        with get_precision_context(state.precision, state.precision_config):
            out = self._ref(**{k: batch[k] for k in _MODEL_INPUT_KEYS if k in batch})
        loss_BT1, _ = per_token_losses(_logits(out), batch["labels"])
        return loss_BT1

    @torch.no_grad()
    def _proxy_eval_losses(
        self, state: State, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = state.model.training
        state.model.eval()
        try:
            with get_precision_context(state.precision, state.precision_config):
                out = state.model({k: batch[k] for k in _MODEL_INPUT_KEYS if k in batch})
        finally:
            state.model.train(was_training)
        return per_token_losses(_logits(out), batch["labels"])

    def _check_batch(self, batch: Any) -> None:
        if not isinstance(batch, Mapping) or "labels" not in batch or "domain_id" not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                f"DoReMi needs dict batches with `labels` (B, T) and `domain_id` (B,); got {keys}. "
                "Use the project's domain-tagged dataset, which adds `domain_id`."
            )
        if not self._checked_batch:
            # Once: out-of-range ids would be a device-side assert on CUDA, so check them here.
            ids = batch["domain_id"]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_domains):
                raise ValueError(
                    f"batch `domain_id` values must be in [0, {self.num_domains}) for domains {self.domain_names}, "
                    f"got min {int(ids.min())} max {int(ids.max())}"
                )
            self._checked_batch = True


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    return outputs.logits


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
