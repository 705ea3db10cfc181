"""What Hugging Face causal-LM adapters share: token ids from the inputs, default positions, the
causal mask built as the model builds it, and the model's own shifted cross-entropy loss.

transformers is imported lazily (only when a Hugging Face model is adapted): hetpipe runs without it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

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
    ``hidden`` stands in for the input embeddings (same shape and dtype)."""
    from transformers.masking_utils import create_causal_mask

    if position_ids is None:
        position_ids = default_positions(hidden)
    if attention_mask is not None and attention_mask.ndim < 4:
        attention_mask = attention_mask.view(hidden.shape[0], -1)
    return position_ids, create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                                            past_key_values=None, position_ids=position_ids)


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
