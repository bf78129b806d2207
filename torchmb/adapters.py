"""B LoRA adapters trained at once on one frozen base model, as the ``peft`` library builds them.

:func:`batch_lora` adds peft's LoRA adapters to a copy of a model (a Hugging Face transformer or any model
peft supports) and batches them: the base model's parameters are shared by all models (stored once,
see :class:`torchmb.BatchModule`'s ``shared``), each target layer becomes a :class:`LoraLinear`
holding B adapters, and every model has its own rank, ``lora_alpha`` and dropout (and, through
:mod:`torchmb.optim`, its own learning rate). Ranks differ by zero-padding to the largest, kept exactly
zero, so model ``i`` computes and trains as the plain peft adapter of rank ``r_i``. The adapters leave as
plain peft state dicts (:meth:`BatchLora.peft_state_dicts`) or as plain ``PeftModel`` instances
(:meth:`BatchLora.unbatch`).

peft is imported when a :class:`BatchLora` is built (``pip install 'torchmb[peft]'``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._lora import LoraDropout, LoraLinear
from ._module import BatchModule
from ._select import survivor_index

__all__ = ["BatchLora", "LoraDropout", "LoraLinear", "batch_lora"]

StateDict = Mapping[str, Any]
PEFT_PREFIX = "base_model.model."  # peft's keys: the PeftModel's, whose base_model.model is the model batched here


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError("torchmb.adapters needs peft: pip install 'torchmb[peft]'") from error
    return peft


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft 0.21 calls transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _per_model(value: Any, batch: int, name: str) -> list[float]:
    values = list(value) if isinstance(value, (Sequence, Tensor)) and not isinstance(value, str) else [value] * batch
    if len(values) != batch or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name}: expected a number or {batch} numbers (one per model), got {value!r}")
    return values


def batch_lora(
    model: nn.Module,
    batch: int,
    *,
    ranks: int | Sequence[int],
    alphas: float | Sequence[float] = 8,
    dropouts: float | Sequence[float] = 0.0,
    target_modules: str | Sequence[str] | None = None,
    seed: int | None = None,
    **lora_options: Any,
) -> BatchLora:
    """``batch`` LoRA adapters on one frozen copy of ``model``, as one module; see :class:`BatchLora`.

    Examples::

        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
        >>> adapters = batch_lora(base, 4, ranks=[1, 2, 4, 8], target_modules=["c_attn"], fan_in_fan_out=True)
        >>> adapters(input_ids=torch.randint(0, 64, (4, 3, 10))).logits.shape
        torch.Size([4, 3, 10, 64])
    """
    return BatchLora(
        model,
        batch,
        ranks=ranks,
        alphas=alphas,
        dropouts=dropouts,
        target_modules=target_modules,
        seed=seed,
        **lora_options,
    )


class BatchLora(BatchModule):
    """``batch`` LoRA adapters (peft's) on one frozen copy of ``model``: a :class:`BatchModule` whose models
    share the base model's parameters and train their own adapters.

    The model is copied (never modified) and wrapped by ``peft.get_peft_model`` with a ``LoraConfig`` of the
    largest rank; the result's ``base_model.model`` is batched, so ``forward`` takes what ``model`` takes,
    each tensor ``(B, n, ...)`` (``input_ids`` ``(B, n, seq)``: model ``i`` reads ``input_ids[i]``).
    Everything ``model`` had is frozen and shared; only the adapters have a model axis.

    Args:
        model: the base model, not a ``PeftModel`` (a Hugging Face transformer, or any model peft can adapt).
        batch: the number of adapters B.
        ranks: each model's rank ``r`` (or one for all).
        alphas: each model's ``lora_alpha``: its update is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with
            ``use_rslora=True``).
        dropouts: each model's ``lora_dropout`` probability, drawn independently per model.
        target_modules: as in ``peft.LoraConfig``; peft's default for known architectures when ``None``.
            The targets must be ``nn.Linear`` layers (or transformers' ``Conv1D``).
        seed: model ``i``'s adapter is initialised as peft initialises one of rank ``r_i`` (``lora_A``
            Kaiming-uniform, or normal with ``init_lora_weights="gaussian"``; ``lora_B`` zero) from a
            generator seeded with ``seed + i``; drawn from torch's generator when ``None``.
        **lora_options: other ``peft.LoraConfig`` fields (``use_rslora``, ``fan_in_fan_out``, ``lora_bias``,
            ``init_lora_weights`` (``True`` or ``"gaussian"``) ...).

    Attributes:
        lora_configs: model ``i``'s ``LoraConfig`` (its rank, alpha and dropout), as peft loads its adapter.
        ranks: model ``i``'s rank.

    State: :meth:`state_dicts` and :meth:`state_dict_of` give the plain state dict of model ``i``'s
    ``PeftModel`` less the ``base_model.model.`` prefix (its adapter of rank ``r_i``); :meth:`load_state_dicts`
    takes such states; :meth:`peft_state_dicts` and :meth:`load_peft_state_dicts` speak peft's adapter
    format (``get_peft_model_state_dict``, ``set_peft_model_state_dict``).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        *,
        ranks: int | Sequence[int],
        alphas: float | Sequence[float] = 8,
        dropouts: float | Sequence[float] = 0.0,
        target_modules: str | Sequence[str] | None = None,
        seed: int | None = None,
        **lora_options: Any,
    ) -> None:
        peft = _import_peft()
        if isinstance(model, peft.PeftModel):
            raise TypeError("batch_lora expects the base model, not a PeftModel: it adds the adapters itself")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int (the number of models), got {batch!r}")
        rank_list = _per_model(ranks, batch, "ranks")
        if not all(isinstance(r, int) and r >= 1 for r in rank_list):
            raise ValueError(f"ranks: expected positive ints, got {rank_list}")
        alpha_list, dropout_list = _per_model(alphas, batch, "alphas"), _per_model(dropouts, batch, "dropouts")
        config = peft.LoraConfig(r=max(rank_list), target_modules=target_modules, **lora_options)
        _check_config(config)
        with _quiet_peft():
            adapted = peft.get_peft_model(copy.deepcopy(model), config).get_base_model()
        adapted_layers = [type(m) for m in adapted.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
        linear = sum(cls is peft.tuners.lora.Linear for cls in adapted_layers)
        if linear != len(adapted_layers):
            raise ValueError(
                f"batch_lora adapts nn.Linear layers (and transformers' Conv1D); target_modules={target_modules!r} "
                f"matched {len(adapted_layers)} layers of which {linear} are Linear"
            )
        super().__init__(adapted, batch)
        layers = self._lora_layers()
        self.lora_configs = [
            dataclasses.replace(config, r=r, lora_alpha=a, lora_dropout=p)
            for r, a, p in zip(rank_list, alpha_list, dropout_list)
        ]
        self.ranks = rank_list
        root = math.sqrt if config.use_rslora else float
        scaling = [a / root(r) for r, a in zip(rank_list, alpha_list)]
        for _, layer in layers:
            layer.set_models(rank_list, scaling, dropout_list)
        # state-dict key of each adapter weight -> its rank dim (lora_A (r, in): 0; lora_B (out, r): 1)
        self._rank_dims = {
            f"{name}.{part}.{layer.adapter}.weight": dim
            for name, layer in layers
            for part, dim in (("lora_A", 0), ("lora_B", 1))
        }
        self._adapter_keys = [key for key in self.module.state_dict() if "lora_" in key]
        self._initialise_adapters(int(torch.randint(0, 2**62, ())) if seed is None else seed, config.init_lora_weights)

    def _lora_layers(self) -> list[tuple[str, LoraLinear]]:
        return [(name, m) for name, m in self.module.named_modules() if isinstance(m, LoraLinear)]

    def _initialise_adapters(self, seed: int, how: bool | str) -> None:
        with torch.no_grad():
            for i, rank in enumerate(self.ranks):
                generator = torch.Generator().manual_seed(seed + i)
                for _, layer in self._lora_layers():
                    lora_A, lora_B = layer.lora_A[layer.adapter], layer.lora_B[layer.adapter]
                    weight = torch.empty(rank, lora_A.in_features, dtype=lora_A.weight.dtype)
                    if how == "gaussian":
                        nn.init.normal_(weight, std=1 / rank, generator=generator)
                    else:  # peft's default: Kaiming-uniform as nn.Linear, a = sqrt(5)
                        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
                    lora_A.weight[i].zero_()
                    lora_A.weight[i, :rank] = weight
                    lora_B.weight[i].zero_()
                    if lora_B.bias is not None:
                        lora_B.bias[i].zero_()

    # -- plain states at each model's rank -----------------------------------------------------------------
    def state_dict_of(self, index: int) -> OrderedDict[str, Tensor]:
        """Model ``index``'s plain state (its ``PeftModel``'s, less ``base_model.model.``), adapter at rank
        ``r_index``."""
        state = super().state_dict_of(index)
        rank = self.ranks[self._check_index(index)]
        for key, dim in self._rank_dims.items():
            state[key] = state[key].narrow(dim, 0, rank).clone()
        return state

    def load_state_dicts(
        self, state_dicts: StateDict | Sequence[StateDict], *, slots: Sequence[int] | None = None
    ) -> None:
        """Load plain states as :meth:`state_dict_of` gives them (adapters at each slot's rank)."""
        if "_rank_dims" not in self.__dict__:  # BatchModule's construction, at the largest rank
            super().load_state_dicts(state_dicts, slots=slots)
            return
        slots = list(range(self.batch)) if slots is None else [self._check_index(s) for s in slots]
        states = [state_dicts] * len(slots) if isinstance(state_dicts, Mapping) else list(state_dicts)
        if len(states) != len(slots):
            raise ValueError(f"expected {len(slots)} state dicts (one per model), got {len(states)}")
        super().load_state_dicts([self._padded(state, slot) for state, slot in zip(states, slots)], slots=slots)

    def _padded(self, state: StateDict, slot: int) -> dict[str, Any]:
        padded = dict(state)
        rank = self.ranks[slot]
        for key, dim in self._rank_dims.items():
            value = state.get(key)
            if value is None:
                continue  # reported with the other missing keys
            if value.dim() != 2 or value.shape[dim] != rank:
                raise ValueError(
                    f"{key!r}: model {slot} has rank {rank}, so expected {rank} in dim {dim}, got shape "
                    f"{tuple(value.shape)}"
                )
            zeros = list(value.shape)
            zeros[dim] = max(self.max_rank - rank, 0)
            padded[key] = torch.cat([value, value.new_zeros(zeros)], dim)
        return padded

    @property
    def max_rank(self) -> int:
        """The largest rank, to which every adapter is padded."""
        return self._lora_layers()[0][1].max_rank

    # -- peft's adapter format ----------------------------------------------------------------------------
    def peft_state_dicts(self) -> list[dict[str, Tensor]]:
        """B adapter state dicts as ``peft.get_peft_model_state_dict`` gives them: load model ``i``'s with
        ``set_peft_model_state_dict`` into a ``PeftModel`` built with ``lora_configs[i]``."""
        return [self._peft_state(self.state_dict_of(i)) for i in range(self.batch)]

    def _peft_state(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        adapter = self._lora_layers()[0][1].adapter
        return {PEFT_PREFIX + key.replace(f".{adapter}", ""): state[key] for key in self._adapter_keys}

    def load_peft_state_dicts(
        self, state_dicts: StateDict | Sequence[StateDict], *, slots: Sequence[int] | None = None
    ) -> None:
        """Load adapters in peft's format (``get_peft_model_state_dict``), one per slot, each at its rank."""
        slots = list(range(self.batch)) if slots is None else [self._check_index(s) for s in slots]
        states = [state_dicts] * len(slots) if isinstance(state_dicts, Mapping) else list(state_dicts)
        if len(states) != len(slots):
            raise ValueError(f"expected {len(slots)} adapter state dicts (one per model), got {len(states)}")
        full = []
        for j, (state, slot) in enumerate(zip(states, slots)):
            current = self.state_dict_of(slot)
            names = self._peft_state(current)
            missing, unexpected = sorted(set(names) - set(state)), sorted(set(state) - set(names))
            if missing or unexpected:
                raise KeyError(f"adapter state dict {j}: missing keys {missing}, unexpected keys {unexpected}")
            lookup = dict(zip(names, self._adapter_keys))
            current.update({lookup[name]: value for name, value in state.items()})
            full.append(current)
        self.load_state_dicts(full, slots=slots)

    def unbatch(self, index: int) -> nn.Module:
        """Model ``index`` as a plain ``PeftModel`` of the base model with its adapter (rank ``r_index``)."""
        peft = _import_peft()
        index = self._check_index(index)
        base = copy.deepcopy(self._template)  # the adapted base model; its LoRA layers are taken out
        for name, module in list(base.named_modules()):
            if isinstance(module, peft.tuners.lora.LoraLayer):
                parent, _, child = name.rpartition(".")
                setattr(base.get_submodule(parent), child, module.get_base_layer())
        base.__dict__.pop("peft_config", None)  # what peft's wrapper left on the model it adapted
        with _quiet_peft():
            model = peft.get_peft_model(base, self.lora_configs[index])
        model.load_state_dict({PEFT_PREFIX + key: value for key, value in self.state_dict_of(index).items()})
        devices = [p.device for p in self.parameters()]
        return model.to(devices[0]) if devices else model

    def select(self, keep: Sequence[int] | Tensor) -> BatchLora:
        """As :meth:`BatchModule.select`; the survivors keep their ranks, alphas and dropouts."""
        index = survivor_index(keep, self.batch)
        super().select(index)
        for _, layer in self._lora_layers():
            layer.keep_models(index)
        self.ranks = [self.ranks[i] for i in index.tolist()]
        self.lora_configs = [self.lora_configs[i] for i in index.tolist()]
        return self


def _check_config(config: Any) -> None:
    if config.init_lora_weights not in (True, "gaussian"):
        raise ValueError(
            f"batch_lora initialises adapters as peft's init_lora_weights=True or 'gaussian' do, got "
            f"{config.init_lora_weights!r}; load other initial weights with load_peft_state_dicts"
        )
    if config.bias != "none" or config.modules_to_save:
        raise ValueError(
            "batch_lora trains the adapters alone on a frozen base model: bias='none' and no modules_to_save "
            f"(got bias={config.bias!r}, modules_to_save={config.modules_to_save!r}); a trainable head or bias "
            "is a BatchModule of its own, with the frozen parameters shared"
        )
    if config.use_dora:
        raise ValueError("batch_lora batches plain LoRA adapters, not DoRA (use_dora=True)")
