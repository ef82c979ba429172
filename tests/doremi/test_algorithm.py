"""The DoReMi Composer algorithm in short Trainer runs on a tiny Llama and an in-memory loader."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from composer import Callback, Event, State, Trainer
from composer.loggers import InMemoryLogger, Logger
from composer.models import HuggingFaceModel
from torch.utils.data import DataLoader

from composer_algos.doremi import DoReMi, DoReMiMixtureWriter
from composer_algos.mixture_io import read_mixture_csv, read_mixture_json
from tests.common.models import tiny_llama

NAMES = ["code", "spam", "wiki"]
SEQ = 12
BATCH = 6


def _examples(n=24, seed=0, domains=None):
    """Seeded examples; `domains` gives each example's domain id (default: cycling 0,1,2)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 128, (SEQ,), generator=gen)
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (1,), generator=gen))] = -100  # prompt-like masked prefix
        dom = (i % 3) if domains is None else domains[i]
        out.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels,
                    "domain_id": torch.tensor(dom)})
    return out


def _trainer(tmp_path, *, ref, steps, mb=BATCH, data=None, proxy=None, lr=0.5, algo_kwargs=None, **kw):
    proxy = tiny_llama(seed=0) if proxy is None else proxy
    model = HuggingFaceModel(proxy, use_logits=True)
    algo = DoReMi(reference=ref, domain_names=NAMES, run_dir=str(tmp_path), **(algo_kwargs or {}))
    loader = DataLoader(_examples() if data is None else data, batch_size=BATCH, shuffle=False)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=torch.optim.SGD(model.parameters(), lr=lr),
        max_duration=f"{steps}ba",
        algorithms=[algo],
        device="cpu",
        device_train_microbatch_size=mb,
        seed=0,
        progress_bar=False,
        log_to_console=False,
        **kw,
    )
    return trainer, algo


def _loop_reference_step(proxy, ref, batch, alpha0, eta=1.0, c=1e-3):
    """Slow, obviously-correct DoReMi step: per example, per token; returns (alpha1, lam, loss)."""
    num_domains = len(alpha0)
    excess = [0.0] * num_domains
    count = [0] * num_domains
    terms = [[] for _ in range(num_domains)]
    for b in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][b : b + 1]
        lp = torch.log_softmax(proxy(input_ids=ids).logits[0].float(), dim=-1)
        with torch.no_grad():
            lr_ = torch.log_softmax(ref(input_ids=ids).logits[0].float(), dim=-1)
        dom = int(batch["domain_id"][b])
        for t in range(SEQ - 1):
            y = int(batch["labels"][b, t + 1])
            if y == -100:
                continue
            proxy_tok = -lp[t, y]
            excess[dom] += max(0.0, proxy_tok.item() + lr_[t, y].item())
            count[dom] += 1
            terms[dom].append(proxy_tok)
    lam = [excess[d] / count[d] if count[d] else 0.0 for d in range(num_domains)]
    unnorm = [alpha0[d] * math.exp(eta * lam[d]) for d in range(num_domains)]
    alpha1 = [(1 - c) * u / sum(unnorm) + c / num_domains for u in unnorm]
    loss = sum(alpha1[d] * torch.stack(terms[d]).sum() / count[d] for d in range(num_domains) if count[d])
    return alpha1, lam, loss


class _CaptureLoss(Callback):
    def __init__(self):
        self.losses = []

    def after_loss(self, state: State, logger: Logger) -> None:
        self.losses.append(state.loss.detach().clone())


def test_first_step_matches_loop_reference(tmp_path):
    ref = tiny_llama(seed=1)
    proxy = tiny_llama(seed=0)
    proxy0 = copy.deepcopy(proxy)
    capture = _CaptureLoss()
    trainer, algo = _trainer(tmp_path, ref=copy.deepcopy(ref), steps=1, proxy=proxy, callbacks=[capture])
    trainer.fit()
    batch = next(iter(DataLoader(_examples(), batch_size=BATCH)))
    alpha1, lam, loss = _loop_reference_step(proxy0, ref, batch, [1 / 3] * 3)
    torch.testing.assert_close(algo.alpha_C, torch.tensor(alpha1, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(algo.last_lam_C, torch.tensor(lam, dtype=torch.float64), rtol=0, atol=1e-5)
    # The loss Composer backpropagated is the alpha_1-weighted per-domain token mean.
    assert len(capture.losses) == 1
    assert capture.losses[0].item() == pytest.approx(loss.item(), rel=1e-5)
    # The proxy's update is SGD on that loss alone: the reference never reaches the proxy's grads.
    loss.backward()
    for (name, p1), p0 in zip(proxy.named_parameters(), proxy0.parameters()):
        assert p0.grad is not None, name
        torch.testing.assert_close(p1, p0 - 0.5 * p0.grad, rtol=1e-4, atol=1e-6, msg=name)
    trainer.close()


def test_reference_runs_in_eval_mode_without_grad(tmp_path):
    ref = tiny_llama(seed=1)
    ref.train()  # the algorithm must switch it to eval mode itself
    seen = []

    def hook(module, args, kwargs):
        seen.append((torch.is_grad_enabled(), module.training))

    ref.register_forward_pre_hook(hook, with_kwargs=True)
    trainer, _ = _trainer(tmp_path, ref=ref, steps=2)
    trainer.fit()
    assert len(seen) == 2  # one reference forward per single-microbatch step
    assert all(not grad_on and not training for grad_on, training in seen)
    assert all(not p.requires_grad and p.grad is None for p in ref.parameters())
    trainer.close()


@pytest.mark.parametrize("mb", [3, 2])
def test_microbatching_gives_the_same_weights_and_update(tmp_path, mb):
    ref = tiny_llama(seed=1)
    full, algo_full = _trainer(tmp_path / "full", ref=copy.deepcopy(ref), steps=3)
    full.fit()
    split, algo_split = _trainer(tmp_path / "split", ref=copy.deepcopy(ref), steps=3, mb=mb)
    split.fit()
    torch.testing.assert_close(algo_split.alpha_C, algo_full.alpha_C, rtol=0, atol=1e-6)
    torch.testing.assert_close(algo_split.averaged_weights(), algo_full.averaged_weights(), rtol=0, atol=1e-6)
    for p, q in zip(split.state.model.parameters(), full.state.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    full.close()
    split.close()


def test_average_includes_initial_weights_and_files_agree(tmp_path):
    init = {"code": 0.6, "spam": 0.3, "wiki": 0.1}
    logger = InMemoryLogger()
    trainer, algo = _trainer(tmp_path, ref=tiny_llama(seed=1), steps=4, loggers=[logger],
                             algo_kwargs={"initial_weights": init, "natural_weights": [1.0, 1.0, 2.0]})
    trainer.fit()
    trainer.close()
    steps, names, rows = read_mixture_csv(tmp_path / "doremi" / "mixture_steps.csv")
    assert steps == [0, 1, 2, 3, 4] and names == NAMES
    assert rows[0].tolist() == pytest.approx([0.6, 0.3, 0.1], abs=1e-12)
    mix = read_mixture_json(tmp_path / "doremi" / "mixture.json")
    assert mix.method == "doremi" and mix.steps == 4
    assert mix.weights_list() == pytest.approx(rows.mean(axis=0).tolist(), abs=1e-9)
    assert mix.weights_list() != pytest.approx(rows[1:].mean(axis=0).tolist(), abs=1e-4)
    assert mix.natural == pytest.approx({"code": 0.25, "spam": 0.25, "wiki": 0.5})
    # Logged through the Composer logger under the domain names.
    logged = logger.data["doremi/weight/spam"]
    assert [v for _, v in logged] == pytest.approx(rows[1:, 1].tolist(), abs=1e-9)
    assert "doremi/excess/wiki" in logger.data
    assert any(isinstance(cb, DoReMiMixtureWriter) for cb in trainer.state.callbacks)


def test_absent_domain_keeps_last_score_in_training(tmp_path):
    # Step 1 sees every domain; step 2 only "code" and "spam".
    domains = [0, 1, 2, 0, 1, 2] + [0, 1, 0, 1, 0, 1]
    logger = InMemoryLogger()
    trainer, algo = _trainer(tmp_path, ref=tiny_llama(seed=1), steps=2, data=_examples(12, domains=domains),
                             loggers=[logger])
    trainer.fit()
    trainer.close()
    wiki = [v for _, v in logger.data["doremi/excess/wiki"]]
    code = [v for _, v in logger.data["doremi/excess/code"]]
    assert wiki[0] > 0 and wiki[1] == wiki[0]
    assert code[1] != code[0]
    # And the second update used the carried score: recompute it from the logged values.
    a1 = torch.tensor([logger.data[f"doremi/weight/{n}"][0][1] for n in NAMES], dtype=torch.float64)
    lam2 = torch.tensor([logger.data[f"doremi/excess/{n}"][1][1] for n in NAMES], dtype=torch.float64)
    unnorm = a1 * torch.exp(lam2)
    expected = 0.999 * unnorm / unnorm.sum() + 0.001 / 3
    torch.testing.assert_close(algo.alpha_C, expected, rtol=0, atol=1e-9)


def test_resume_matches_uninterrupted_run(tmp_path):
    ref = tiny_llama(seed=1)
    whole, algo_whole = _trainer(tmp_path / "whole", ref=copy.deepcopy(ref), steps=4)
    whole.fit()
    whole.close()
    first, _ = _trainer(tmp_path / "resumed", ref=copy.deepcopy(ref), steps=2,
                        save_folder=str(tmp_path / "ckpt"), save_interval="2ba", save_filename="ba{batch}.pt")
    first.fit()
    first.close()
    second, algo_second = _trainer(tmp_path / "resumed", ref=copy.deepcopy(ref), steps=4,
                                   load_path=str(tmp_path / "ckpt" / "ba2.pt"))
    assert algo_second.num_updates == 2  # restored from the checkpoint's algorithm state
    second.fit()
    second.close()
    assert algo_second.num_updates == 4
    torch.testing.assert_close(algo_second.alpha_C, algo_whole.alpha_C, rtol=0, atol=1e-6)
    torch.testing.assert_close(algo_second.averaged_weights(), algo_whole.averaged_weights(), rtol=0, atol=1e-6)
    s_whole, _, rows_whole = read_mixture_csv(tmp_path / "whole" / "doremi" / "mixture_steps.csv")
    s_res, _, rows_res = read_mixture_csv(tmp_path / "resumed" / "doremi" / "mixture_steps.csv")
    assert s_res == s_whole == [0, 1, 2, 3, 4]
    torch.testing.assert_close(torch.from_numpy(rows_res), torch.from_numpy(rows_whole), rtol=0, atol=1e-6)


def test_state_dict_round_trip():
    algo = DoReMi(reference=tiny_llama(seed=1), domain_names=NAMES, initial_weights="natural",
                  natural_weights=[0.5, 0.25, 0.25])
    algo.alpha_C = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    algo.last_lam_C = torch.tensor([0.1, 0.0, 0.7], dtype=torch.float64)
    algo.alpha_sum_C = torch.tensor([1.0, 0.8, 1.2], dtype=torch.float64)
    algo.num_updates = 2
    other = DoReMi(reference=tiny_llama(seed=1), domain_names=NAMES)
    other.load_state_dict(algo.state_dict())
    for name in ("alpha_C", "last_lam_C", "alpha_sum_C", "initial_alpha_C"):
        torch.testing.assert_close(getattr(other, name), getattr(algo, name))
    assert other.num_updates == 2
    torch.testing.assert_close(other.averaged_weights(), torch.tensor([1.0, 0.8, 1.2], dtype=torch.float64) / 3)
    with pytest.raises(ValueError, match="domains"):
        DoReMi(reference=tiny_llama(seed=1), domain_names=["a", "b", "c"]).load_state_dict(algo.state_dict())


def test_match_events():
    algo = DoReMi(reference=tiny_llama(seed=1), domain_names=NAMES)
    state = None  # match() only looks at the event
    hooked = {Event.INIT, Event.FIT_START, Event.AFTER_DATALOADER, Event.AFTER_LOSS, Event.BATCH_END}
    for event in Event:
        assert algo.match(event, state) == (event in hooked), event  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"domain_names": ["a", "a"]}, "unique"),
        ({"eta_dro": 0.0}, "eta_dro"),
        ({"smoothing": -0.1}, "smoothing"),
        ({"initial_weights": "natural"}, "natural_weights"),
        ({"natural_weights": [1.0, 2.0]}, "natural_weights"),
    ],
)
def test_constructor_errors(kwargs, match):
    args = {"reference": tiny_llama(seed=1), "domain_names": NAMES, **kwargs}
    with pytest.raises(ValueError, match=match):
        DoReMi(**args)


def test_batches_without_domain_id_are_rejected(tmp_path):
    data = [{k: v for k, v in ex.items() if k != "domain_id"} for ex in _examples(6)]
    trainer, _ = _trainer(tmp_path, ref=tiny_llama(seed=1), steps=1, data=data)
    with pytest.raises(ValueError, match="domain_id"):
        trainer.fit()
    trainer.close()


def test_out_of_range_domain_ids_are_rejected(tmp_path):
    trainer, _ = _trainer(tmp_path, ref=tiny_llama(seed=1), steps=1, data=_examples(6, domains=[0, 1, 2, 3, 0, 1]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        trainer.fit()
    trainer.close()


def test_reference_sharing_proxy_parameters_is_rejected(tmp_path):
    proxy = tiny_llama(seed=0)
    trainer, _ = _trainer(tmp_path, ref=proxy, proxy=proxy, steps=1)
    with pytest.raises(ValueError, match="shares parameters"):
        trainer.fit()
    trainer.close()
