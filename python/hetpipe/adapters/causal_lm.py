"""What Hugging Face causal-LM adapters share: token ids from the inputs, default positions, the
causal mask built as the model builds it, and the model's own shifted cross-entropy loss.

transformers is imported lazily (only when a Hugging Face model is adapted): hetpipe runs without it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from hetpipe.adapters.errors import AdapterError


def token_ids(inputs: Any, layer: str) -> torch.Tensor:
    """``input_ids`` of the minibatch inputs (a dict holding them, or the tensor itself)."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, Mapping) and "input_ids" in inputs:
        return inputs["input_ids"]
    raise AdapterError(f"hetpipe: layer {layer} takes the minibatch inputs as a tensor of token ids or a dict "
                       f"with 'input_ids', got {type(inputs).__name__}"
                       + (f" with keys {sorted(inputs)}" if isinstance(inputs, Mapping) else ""))


def optional_input(inputs: Any, key: str) -> Optional[torch.Tensor]:
    return inputs.get(key) if isinstance(inputs, Mapping) else None


def default_positions(hidden: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1 as a (1, T) tensor: what the model uses when given none and no cache."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def positions_and_mask(config: Any, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                       position_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Any]:
    """A block's position ids (the default when none are given) and the causal mask the model's own
    forward builds for its attention implementation (None where sdpa's ``is_causal`` suffices);
    ``hidden`` stands in for the input embeddings (same shape and dtype).

    The library reads the mask's values to decide whether any token is padding, up to twice; here
    the mask is read once (one host-device synchronisation), and the library is told the answer: a
    mask of ones masks nothing, so it builds what it builds for no mask (without a data-dependent
    check); a mask with padding is materialised without its checks for a skip that padding excludes.
    Default positions (0..T-1, no packed sequences) are not given to it, so it does not search them
    for packed sequences either. The mask is the one the model's forward builds from the same inputs."""
    from transformers.masking_utils import create_causal_mask

    given = position_ids
    if position_ids is None:
        position_ids = default_positions(hidden)
    if attention_mask is not None and attention_mask.ndim < 4:
        attention_mask = attention_mask.view(hidden.shape[0], -1)
    options: Dict[str, Any] = {}
    if attention_mask is not None and attention_mask.ndim == 2 and attention_mask.shape[1] == hidden.shape[1]:
        if bool(attention_mask.all()):
            attention_mask = given = None
        elif _takes_skip_option(create_causal_mask):
            options["allow_is_causal_skip"] = False
    return position_ids, create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                                            past_key_values=None, position_ids=given, **options)


@functools.lru_cache(maxsize=None)
def _takes_skip_option(create_causal_mask: Callable) -> bool:
    """Whether this transformers' ``create_causal_mask`` takes ``allow_is_causal_skip`` (5.x does)."""
    return "allow_is_causal_skip" in inspect.signature(create_causal_mask).parameters


class CausalMasks:
    """The blocks' :func:`positions_and_mask`, built once per forward and shared by the blocks of one
    model, as the model's own forward builds it once before its blocks.

    A block asks with the side inputs of its minibatch (the very tensors every block of a stage gets
    in one forward, and its recompute again) and its input's shape, dtype and device; the first block
    builds the mask and the others reuse it, so a stage reads the mask's values once per forward
    instead of once per block. Contract: side inputs are not modified in place while a forward uses
    them (they are the minibatch's inputs). An entry lives as long as the side-input tensors it was
    built from (dropped when they are freed); one for no side input at all is kept per shape.
    A copy (the stage's private layers) starts empty."""

    def __init__(self, config: Any) -> None:
        self.config = config
        # key -> (weak references to the side inputs it was built from, (position ids, mask))
        self._built: Dict[Tuple[Any, ...], Tuple[Tuple[Optional[weakref.ref], ...], Tuple[torch.Tensor, Any]]] = {}

    def __call__(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 position_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Any]:
        sources = (attention_mask, position_ids)
        key = (*(None if t is None else id(t) for t in sources), tuple(hidden.shape[:2]), hidden.dtype, hidden.device)
        hit = self._built.get(key)
        if hit is not None and all((r is None) == (t is None) and (r is None or r() is t)
                                   for r, t in zip(hit[0], sources)):
            return hit[1]
        built = positions_and_mask(self.config, hidden, attention_mask, position_ids)
        forget = functools.partial(self._forget, key)
        self._built[key] = (tuple(None if t is None else weakref.ref(t, forget) for t in sources), built)
        return built

    def _forget(self, key: Tuple[Any, ...], _ref: weakref.ref) -> None:
        self._built.pop(key, None)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "CausalMasks":
        return type(self)(copy.deepcopy(self.config, memo))

    def __getstate__(self) -> Dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["config"])


def call_block(block: nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``block(hidden, **kwargs)`` with every argument by keyword, those its ``forward`` neither names
    nor takes as ``**kwargs`` left out (transformers 4.x blocks take no ``position_ids``), and the
    hidden states of what it returns (a 4.x block returns a tuple, a 5.x block the tensor)."""
    takes = _keywords(type(block))
    out = block(hidden, **{k: v for k, v in kwargs.items() if takes is None or k in takes})
    return out[0] if isinstance(out, tuple) else out


@functools.lru_cache(maxsize=None)
def _keywords(cls: type) -> Optional[frozenset]:
    """The keywords ``cls.forward`` names; None when it takes any (``**kwargs``)."""
    params = inspect.signature(cls.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


class CausalLMLoss:
    """``loss(logits, labels)``: the model's own causal-LM loss (what ``model.loss_function`` resolves
    to: labels shifted left by one inside, -100 ignored, mean over the remaining tokens), so
    ``labels = input_ids``. Resolved here as that property does, without its once-per-process notice
    that a model without ``loss_type`` gets the causal-LM default (once per rank otherwise)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.loss.loss_utils import LOSS_MAPPING

        custom = model.__dict__.get("_loss_function")
        self.loss_function = custom or LOSS_MAPPING.get(getattr(model, "loss_type", None), LOSS_MAPPING["ForCausalLM"])
        self.vocab_size = model.config.vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)

    def __repr__(self) -> str:
        return f"CausalLMLoss(vocab_size={self.vocab_size})"


def check_side_inputs(side_inputs: Tuple[str, ...], adapter: str) -> Tuple[str, ...]:
    allowed = ("attention_mask", "position_ids")
    for k in side_inputs:
        if k not in allowed:
            raise AdapterError(f"hetpipe.adapters.{adapter}: side input {k!r} is not one a block uses "
                               f"(choose among {allowed})")
    return tuple(side_inputs)
