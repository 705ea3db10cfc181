"""Hugging Face GPT-2 (``GPT2LMHeadModel``) as [embeddings, block_0..block_{n-1}, ln_f + lm_head].

Each layer calls the model's own modules as ``GPT2Model.forward`` does, the blocks by keyword (so that
blocks of transformers 4.x and 5.x alike get what they name); the blocks build the causal mask from
the side inputs with the library's own ``create_causal_mask`` once per forward, shared among them
(:class:`~hetpipe.adapters.causal_lm.CausalMasks`), as the model's forward builds it once before its
blocks. The head holds the model's ``lm_head``, whose weight is the embedding's ``wte.weight`` when tied.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from hetpipe.adapters.adapted import Adapted
from hetpipe.adapters.causal_lm import (CausalLMLoss, CausalMasks, call_block, check_side_inputs, default_positions,
                                        optional_input, token_ids)
from hetpipe.adapters.errors import AdapterError, has_attrs, require

GPT2_ATTRS = ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h", "transformer.ln_f",
              "lm_head", "config")


def is_gpt2(model: nn.Module) -> bool:
    return has_attrs(model, GPT2_ATTRS)


class GPT2Embeddings(nn.Module):
    """Layer 0: token + position (+ token type) embeddings, then dropout. Reads ``input_ids`` and,
    when present in the inputs dict, ``position_ids`` and ``token_type_ids``."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, inputs: Any) -> torch.Tensor:
        ids = token_ids(inputs, "0 (GPT-2 embeddings)")
        ids = ids.view(-1, ids.shape[-1])
        hidden = self.wte(ids)
        positions = optional_input(inputs, "position_ids")
        if positions is None:
            positions = default_positions(hidden)
        hidden = hidden + self.wpe(positions)
        token_types = optional_input(inputs, "token_type_ids")
        if token_types is not None:
            hidden = hidden + self.wte(token_types.view(-1, ids.shape[-1]))
        return self.drop(hidden)


class GPT2BlockLayer(nn.Module):
    """One ``GPT2Block``, fed the causal mask its model would build (no cache, no cross-attention);
    ``masks``: the mask builder the model's blocks share."""

    def __init__(self, block: nn.Module, masks: CausalMasks, side_inputs: Sequence[str]) -> None:
        super().__init__()
        self.block, self.masks = block, masks
        self.hetpipe_side_inputs = tuple(side_inputs)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        position_ids, mask = self.masks(hidden, attention_mask, position_ids)
        return call_block(self.block, hidden, attention_mask=mask, use_cache=False, position_ids=position_ids)


class LMHead(nn.Module):
    """Last layer of a causal LM: final norm, then the (possibly tied) output projection -> logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def gpt2(model: nn.Module, side_inputs: Sequence[str] = ("attention_mask",)) -> Adapted:
    """``GPT2LMHeadModel`` -> [GPT2Embeddings, GPT2BlockLayer x n_layer, LMHead] and its causal-LM loss.

    side_inputs: keys of the minibatch inputs dict every block takes (``attention_mask``,
    ``position_ids``); ``()`` when the inputs are a bare tensor of token ids."""
    require(model, GPT2_ATTRS, "gpt2")
    side_inputs = check_side_inputs(tuple(side_inputs), "gpt2")
    if getattr(model.config, "add_cross_attention", False):
        raise AdapterError("hetpipe.adapters.gpt2: config.add_cross_attention is set; blocks with "
                           "cross-attention need encoder states, which this layout does not carry")
    t = model.transformer
    layers = [GPT2Embeddings(t.wte, t.wpe, t.drop)]
    masks = CausalMasks(model.config)
    layers += [GPT2BlockLayer(block, masks, side_inputs) for block in t.h]
    layers.append(LMHead(t.ln_f, model.lm_head))
    names = ["embed", *(f"h.{i}" for i in range(len(t.h))), "head"]
    return Adapted(nn.ModuleList(layers), names, CausalLMLoss(model), model)
