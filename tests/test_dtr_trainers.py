"""dtr() inside the training loops people use rather than write:
transformers' Trainer (the whole step in the block, by overriding
`training_step`, or the forward and loss alone, by overriding
`compute_loss`) and Lightning (the forward alone in the block, inside the
LightningModule's `training_step`; Lightning runs the backward after it).
Each trains bit-exactly with the plain loop under chaos, gradient
accumulation and the frameworks' own optimizer, scheduler and clipping
included, and transformers' batch-size finder lowers the batch until the
step fits a session's budget (README, "Training under a memory budget";
tests/test_oom_message.py checks the finders' own predicates)."""
from __future__ import annotations

import functools
import logging
import tempfile

import pytest
import torch

from dtralloc.dtr import dtr

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it


# ---- transformers' Trainer ---------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(config)


def _session_trainer(where: str = "step", **session):
    """The README's recipes: the whole step (forward, loss, backward) in a
    session, by overriding `training_step`, or the forward and loss alone,
    by overriding `compute_loss` (the Trainer runs the backward after it).
    The optimizer, scheduler and clipping run after either."""

    class SessionTrainer(transformers.Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            run = functools.partial(super().training_step, model, inputs, *args, **kwargs)
            return self._in_session(inputs, run) if where == "step" else run()

        def compute_loss(self, model, inputs, *args, **kwargs):
            run = functools.partial(super().compute_loss, model, inputs, *args, **kwargs)
            return self._in_session(inputs, run) if where == "forward" else run()

        def _in_session(self, inputs, run):
            s = dtr(device="cpu", **session)
            self.sessions.append((inputs["input_ids"].shape[0], s))  # those that run out too
            with s:
                out = run()
            self.remats_in_block.append(s.stats()["remats"])
            return out

    SessionTrainer.sessions = []
    SessionTrainer.remats_in_block = []
    return SessionTrainer


def _fit_trainer(cls, steps: int, **args):
    model = _gpt2()
    with tempfile.TemporaryDirectory() as out:
        arguments = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, use_cpu=True, report_to=[], logging_steps=1,
            save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0, **args)
        trainer = cls(model=model, args=arguments, train_dataset=_Tokens(64, 64, 512))
        trainer.train()
    return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _same_parameters(a, b) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("where", ["step", "forward"])
def test_transformers_trainer_trains_bit_exactly_in_a_session(where, one_thread):
    args = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
                lr_scheduler_type="linear", warmup_steps=1)
    plain, want = _fit_trainer(transformers.Trainer, 3, **args)
    cls = _session_trainer(where, chaos=True)
    model, got = _fit_trainer(cls, 3, **args)
    assert got == want and len(got) == 3
    assert _same_parameters(model, plain)
    assert len(cls.sessions) == 6  # two micro-batches a step
    assert all(s.stats()["evictions"] > 0 and s.stats()["remats"] > 0 and s.stats()["rng_replays"] > 0
               for _, s in cls.sessions)
    if where == "forward":  # the Trainer's backward, after the block, brought evicted values back
        assert len(cls.remats_in_block) == 6
        assert all(s.stats()["remats"] > n for (_, s), n in zip(cls.sessions, cls.remats_in_block))


def test_transformers_trainer_finds_the_batch_that_fits_the_budget(one_thread):
    # auto_find_batch_size lowers the batch each time a step raises an
    # out-of-memory error accelerate recognises: the session's must be one.
    # The `size` policy reads no op cost, so every run makes the same choices
    # and finds the same batch.
    cls = _session_trainer(budget="8M", policy="size")
    model, got = _fit_trainer(cls, 2, per_device_train_batch_size=64, auto_find_batch_size=True)
    sizes = [n for n, _ in cls.sessions]
    fitted = sizes[-1]
    assert sizes[-2:] == [fitted, fitted] and fitted < 64 and len(sizes) > 2
    assert all(a > b for a, b in zip(sizes[:-2], sizes[1:-1]))
    assert all(s.stats()["ooms"] == 1 for _, s in cls.sessions[:-2])
    assert all(s.stats()["peak_bytes"] <= s.stats()["budget_bytes"] == 8 * 2**20 for _, s in cls.sessions[-2:])
    assert sum(s.stats()["evictions"] for _, s in cls.sessions[-2:]) > 0
    assert len(got) == 2 and all(torch.isfinite(p).all() for p in model.parameters())


# ---- Lightning -----------------------------------------------------------------


def _lightning():
    L = pytest.importorskip("lightning")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return L


# Lightning 2.6 on torch 2.13: its pytree helper uses torch's deprecated LeafSpec.
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
def test_lightning_trains_bit_exactly_with_the_forward_in_a_session(one_thread):
    L = _lightning()
    sessions = []

    class Module(L.LightningModule):
        def __init__(self, session):
            super().__init__()
            self.session = session
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                                                 torch.nn.Dropout(0.1)) for _ in range(4)])

        def training_step(self, batch, index):
            (x,) = batch
            if not self.session:
                return self.net(x).square().mean()
            # The README's recipe: the forward alone in the block; Lightning
            # runs the backward after it, recomputing what was evicted.
            with dtr(device="cpu", chaos=True) as s:
                loss = self.net(x).square().mean()
            sessions.append((s, s.stats()["remats"]))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    def fit(session: bool):
        L.seed_everything(0, verbose=False)
        module = Module(session)
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(64, 64, generator=torch.Generator().manual_seed(1))),
            batch_size=16)
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                            gradient_clip_val=0.5)
        trainer.fit(module, data)
        return module

    want = fit(False)
    got = fit(True)
    assert _same_parameters(got, want)
    assert len(sessions) == 8
    for s, remats_in_block in sessions:
        stats = s.stats()
        # Evicted in the block, brought back by the backward Lightning ran after it.
        assert stats["evictions"] > 0 and stats["remats"] > remats_in_block and stats["rng_replays"] > 0
