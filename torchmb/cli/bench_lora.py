"""The LoRA workloads of ``python -m torchmb bench``: B adapters fine-tuned at once on one frozen decoder.

A Hugging Face decoder built from a config (no download; random weights time like trained ones), causal
language modelling on random tokens of ``SEQUENCE`` positions, LoRA on the attention projections, AdamW.
Model ``i`` has rank ``RANKS[i % len(RANKS)]``, alpha twice its rank and its own learning rate. Three
implementations, each a full training step (forward, loss, backward, optimizer step) for all B models:

- ``torchmb``: :func:`torchmb.adapters.batch_lora`, the decoder stored once, the B adapters padded to the
  largest rank, :class:`torchmb.optim.AdamW` with per-model learning rates (``torchmb+compile``: forward and
  loss under ``torch.compile``);
- ``limit``: one peft model with one adapter of the largest rank trained on all B*n sequences;
- ``loop``: B peft models (B copies of the decoder), each with its own ``torch.optim.AdamW``.

Run on a GPU as ``python -m torchmb bench --workloads lora-llama --samples 4 --precision bf16`` (n sequences
per model: 4 times 256 tokens). peft and transformers are imported when a workload is built.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import _quiet_peft, batch_lora
from ..optim import AdamW
from .bench_steps import Step, Workload, register_workload, summed_cross_entropy

__all__ = ["LORA_LLAMA", "LoraSteps", "llama_config"]

SEQUENCE = 256
VOCAB = 32000
RANKS = (4, 8, 16)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def llama_config(hidden: int = 768, layers: int = 12, vocab: int = VOCAB, sequence: int = SEQUENCE) -> object:
    """A Llama decoder's config: at the defaults, 134M parameters (GPT-2 small's shape, Llama's blocks)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=max(64, hidden * 8 // 3 // 64 * 64),
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=sequence,
    )


def _decoder(make_config: Callable[[], object]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(make_config())

    return make


class LoraSteps:
    """Builders of the LoRA implementations' steps for B adapters (the interface of ``_bench_steps.Steps``)."""

    def __init__(
        self,
        workload: Workload,
        batch: int,
        samples: int,
        device: torch.device,
        precision: str = "fp32",
        channels_last: bool = False,
    ) -> None:
        self.workload, self.batch, self.samples, self.device = workload, batch, samples, device
        self.precision = precision
        self.base = workload.make().eval()  # on the host until a builder runs; eval: no dropout, as peft's default
        self.vocab = self.base.config.vocab_size
        sequence = self.base.config.max_position_embeddings
        self.x = torch.randint(0, self.vocab, (batch, samples, sequence), device=device)
        self.y = torch.randint(0, self.vocab, (batch, samples, sequence), device=device)
        self.ranks = [RANKS[i % len(RANKS)] for i in range(batch)]
        self.alphas = [2.0 * r for r in self.ranks]
        self.lrs = [1e-4 * math.sqrt(2) ** (i % 6) for i in range(batch)]

    def builders(self) -> dict[str, Callable[[], Step]]:
        """The step builder of each implementation, by name."""
        builders = {
            "torchmb": lambda: self._torchmb(),
            "torchmb+compile": lambda: self._torchmb(compiled=True),
            "limit": self._limit,
            "limit+compile": lambda: self._limit(compiled=True),
        }
        if self.batch <= 64:
            builders["loop"] = self._loop
        return builders

    def _amp(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def _peft_model(self, rank: int, alpha: float) -> nn.Module:
        import peft

        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS)
        with _quiet_peft():
            return peft.get_peft_model(copy.deepcopy(self.base), config).to(self.device)

    def _torchmb(self, compiled: bool = False) -> Step:
        batched = batch_lora(
            self.base, self.batch, ranks=self.ranks, alphas=self.alphas, target_modules=TARGETS, seed=0
        ).to(self.device)
        optimizer = AdamW(batched.parameters(), lr=self.lrs)  # the shared decoder is skipped
        samples = self.samples * self.x.shape[-1]

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._amp():
                return summed_cross_entropy(batched(input_ids=x).logits, y, samples)

        step = _step(torch.compile(loss_of) if compiled else loss_of, optimizer, self.x, self.y)
        step.model = batched  # for inspection
        return step

    def _limit(self, compiled: bool = False) -> Step:
        one = self._peft_model(max(self.ranks), 2.0 * max(self.ranks))
        optimizer = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=self.lrs[0])
        x, y = self.x.flatten(0, 1), self.y.flatten(0, 1)

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._amp():
                return F.cross_entropy(one(input_ids=x).logits.flatten(0, 1), y.flatten())

        return _step(torch.compile(loss_of) if compiled else loss_of, optimizer, x, y)

    def _loop(self) -> Step:
        plain = [self._peft_model(r, a) for r, a in zip(self.ranks, self.alphas)]
        optimizers = [
            torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for m, lr in zip(plain, self.lrs)
        ]

        def step() -> None:
            for i, (model, optimizer) in enumerate(zip(plain, optimizers)):
                optimizer.zero_grad(set_to_none=True)
                with self._amp():
                    loss = F.cross_entropy(model(input_ids=self.x[i]).logits.flatten(0, 1), self.y[i].flatten())
                loss.backward()
                optimizer.step()

        return step


def _step(loss_of: Callable, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        optimizer.step()

    return step


#: ``lora-llama``: 16 LoRA adapters on a 134M-parameter Llama decoder (see the module docstring).
LORA_LLAMA = register_workload(
    Workload(
        "lora-llama",
        _decoder(llama_config),
        lambda lead, device: torch.empty(0),  # LoraSteps makes its own tokens
        (16,),
        classes=VOCAB,
        steps=LoraSteps,
        implementations=("torchmb", "limit", "loop"),
    )
)
