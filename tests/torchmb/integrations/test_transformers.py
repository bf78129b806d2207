"""torchmb.integrations.transformers against B plain copies of a Hugging Face model trained by plain torch."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from support.torchvision_ops import import_torchvision

if importlib.util.find_spec("torchvision"):  # transformers' Trainer imports it: see tests/support/torchvision_ops.py
    import_torchvision()
transformers = pytest.importorskip("transformers", reason="the [transformers] extra is not installed")
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

import torchmb  # noqa: E402
from torchmb.integrations.transformers import BatchTrainer  # noqa: E402

B, SAMPLES, SEQ, STEPS, VOCAB = 8, 4, 12, 4, 40
LRS = torch.logspace(-3, -1, B, dtype=torch.float64)
CONFIG = GPT2Config(
    n_layer=2, n_embd=32, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
GENERATOR = torch.Generator().manual_seed(0)
TOKENS = torch.randint(1, VOCAB, (SAMPLES * STEPS, SEQ), generator=GENERATOR)
LABELS = TOKENS.clone()
LABELS[:, :3] = -100  # the prompt's tokens carry no loss


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(TOKENS)

    def __getitem__(self, i: int) -> dict:
        # explicit position ids: GPT-2's own (1, seq) ones do not convert yet (the converter's open issue)
        return {"input_ids": TOKENS[i], "labels": LABELS[i], "position_ids": torch.arange(SEQ)}


def arguments(tmp_path, **kwargs) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=SAMPLES, max_steps=STEPS, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, max_grad_norm=0.5, warmup_steps=2,
        weight_decay=0.01, lr_scheduler_type="linear", disable_tqdm=True, train_sampling_strategy="sequential",
    )
    return TrainingArguments(**{**options, **kwargs})


def plain_run(models: torchmb.BatchModule, args: TrainingArguments) -> tuple[list[dict], list[list[float]]]:
    """Each model alone, by plain torch: the Trainer's data order, AdamW groups, schedule and clipping."""
    states, losses = [], []
    for i, state in enumerate(models.state_dicts()):
        model = GPT2LMHeadModel(CONFIG).double()
        model.load_state_dict(state)
        decay = [p for n, p in model.named_parameters() if "bias" not in n and "ln_" not in n]
        no_decay = [p for n, p in model.named_parameters() if "bias" in n or "ln_" in n]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=float(LRS[i]), betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        )
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup_steps, STEPS)
        mine = []
        for step in range(STEPS):
            rows = slice(step * SAMPLES, (step + 1) * SAMPLES)
            loss = model(input_ids=TOKENS[rows], labels=LABELS[rows]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            mine.append(loss.item())
        states.append(model.state_dict())
        losses.append(mine)
    return states, losses


def batch_of_gpt2s(seed: int = 0) -> torchmb.BatchModule:
    return torchmb.BatchModule.from_factory(lambda: GPT2LMHeadModel(CONFIG).double(), B, seed=seed)


@pytest.mark.filterwarnings("ignore:torchmb. .* batched through torch.func:UserWarning")  # GPT-2's Conv1D
def test_a_sweep_of_gpt2s_trains_each_as_plain_torch_would(tmp_path) -> None:
    models = batch_of_gpt2s()
    args = arguments(tmp_path)
    states, losses = plain_run(models, args)
    trainer = BatchTrainer(models, args, learning_rates=LRS, train_dataset=Tokens())
    trainer.train()
    for i, state in enumerate(states):
        for key, value in models.state_dict_of(i).items():
            torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-7, msg=f"model {i}: {key}")
    logged = [entry for entry in trainer.state.log_history if "loss/model_0" in entry]
    assert len(logged) == STEPS
    for step, entry in enumerate(logged):
        per_model = [entry[f"loss/model_{i}"] for i in range(B)]
        assert per_model == pytest.approx([model_losses[step] for model_losses in losses], rel=1e-5)
        assert entry["loss"] == pytest.approx(sum(per_model) / B)
        lr_factor = step / 2 if step < 2 else (STEPS - step) / (STEPS - 2)  # the step's lr: linear, 2 warm-up steps
        assert [entry[f"learning_rate/model_{i}"] for i in range(B)] == pytest.approx((LRS * lr_factor).tolist())
        assert all(entry[f"grad_norm/model_{i}"] > 0 for i in range(B))
    json.dumps(trainer.state.log_history)  # the logs stay plain numbers
    metrics = trainer.evaluate(Tokens())
    with torch.no_grad():
        for i, state in enumerate(states):
            model = GPT2LMHeadModel(CONFIG).double()
            model.load_state_dict(state)
            plain = [model(input_ids=TOKENS[r : r + SAMPLES], labels=LABELS[r : r + SAMPLES]).loss.item()
                     for r in range(0, len(TOKENS), SAMPLES)]
            assert metrics[f"eval_loss/model_{i}"] == pytest.approx(sum(plain) / len(plain), rel=1e-5)


@pytest.mark.filterwarnings("ignore:torchmb. .* batched through torch.func:UserWarning")
def test_changing_one_models_lr_leaves_the_others_bit_identical(tmp_path) -> None:
    finals = []
    for last_lr in (1e-3, 1.0):
        models = batch_of_gpt2s()
        lrs = LRS.clone()
        lrs[-1] = last_lr
        BatchTrainer(models, arguments(tmp_path), learning_rates=lrs, train_dataset=Tokens()).train()
        finals.append(models.state_dicts())
    for i in range(B - 1):
        assert all(torch.equal(finals[0][i][k], finals[1][i][k]) for k in finals[0][i]), f"model {i} moved"
    assert not torch.equal(finals[0][-1]["transformer.wte.weight"], finals[1][-1]["transformer.wte.weight"])


@pytest.mark.filterwarnings("ignore:torchmb. .* batched through torch.func:UserWarning")
def test_what_has_no_per_model_version_is_refused(tmp_path) -> None:
    models = batch_of_gpt2s()
    with pytest.raises(TypeError, match=r"trains a torchmb\.BatchModule"):
        BatchTrainer(GPT2LMHeadModel(CONFIG), arguments(tmp_path))
    with pytest.raises(TypeError, match=r"expected a torchmb\.optim optimizer"):
        BatchTrainer(models, arguments(tmp_path), optimizers=(torch.optim.SGD(models.parameters()), None))
    with pytest.raises(ValueError, match="learning_rates: expected a number or 8 values"):
        BatchTrainer(models, arguments(tmp_path), learning_rates=[0.1, 0.2])
    trainer = BatchTrainer(models, arguments(tmp_path, optim="adafactor"), train_dataset=Tokens())
    with pytest.raises(ValueError, match="optim='adafactor' has no per-model version"):
        trainer.train()


@pytest.mark.filterwarnings("ignore:torchmb. .* batched through torch.func:UserWarning")
def test_checkpoint_and_resume_reproduce_an_uninterrupted_run(tmp_path) -> None:
    whole = batch_of_gpt2s()
    BatchTrainer(whole, arguments(tmp_path / "whole"), learning_rates=LRS, train_dataset=Tokens()).train()
    saving = arguments(tmp_path / "run", save_strategy="steps", save_steps=2)
    BatchTrainer(batch_of_gpt2s(), saving, learning_rates=LRS, train_dataset=Tokens()).train()
    resumed = batch_of_gpt2s(seed=1)  # the checkpoint's weights, optimizer state and schedule replace these
    trainer = BatchTrainer(resumed, saving, learning_rates=LRS, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for i, state in enumerate(whole.state_dicts()):
        assert all(torch.equal(resumed.state_dict_of(i)[k], v) for k, v in state.items()), f"model {i}"
