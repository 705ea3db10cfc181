"""Llama-style decoders (``LlamaForCausalLM`` and models of the same shape: model.embed_tokens ->
model.layers -> model.norm -> lm_head, rotary embeddings in model.rotary_emb) as layer lists.

Each block recomputes the rotary (cos, sin) from the side inputs exactly as the model's forward
computes it once (cheap next to a block, and a stage boundary then carries one hidden-state tensor);
the causal mask is built once per forward and shared by the blocks
(:class:`~hetpipe.adapters.causal_lm.CausalMasks`), as the model's forward builds it once.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch import nn

from hetpipe.adapters.adapted import Adapted
from hetpipe.adapters.causal_lm import CausalLMLoss, CausalMasks, call_block, check_side_inputs, token_ids
from hetpipe.adapters.errors import AdapterError, has_attrs, require
from hetpipe.adapters.gpt2 import LMHead

DECODER_ATTRS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head", "config")


def is_decoder(model: nn.Module) -> bool:
    return has_attrs(model, DECODER_ATTRS)


class TokenEmbedding(nn.Module):
    """Layer 0: the token embedding of ``input_ids`` (a tensor, or the key of the inputs dict)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs: Any) -> torch.Tensor:
        return self.embed_tokens(token_ids(inputs, "0 (token embedding)"))


class DecoderBlock(nn.Module):
    """One decoder layer, fed the causal mask and rotary (cos, sin) its model would compute; ``masks``:
    the mask builder the model's blocks share."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, masks: CausalMasks, side_inputs: Sequence[str]) -> None:
        super().__init__()
        # A private copy of the rotary module (it holds only non-persistent buffers): each layer is
        # self-contained, so a stage can be moved to its device without touching another stage's.
        self.layer, self.rotary_emb, self.masks = layer, copy.deepcopy(rotary_emb), masks
        self.hetpipe_side_inputs = tuple(side_inputs)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        position_ids, mask = self.masks(hidden, attention_mask, position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        return call_block(self.layer, hidden, attention_mask=mask, position_embeddings=position_embeddings,
                          position_ids=position_ids, use_cache=False)


def decoder(model: nn.Module, side_inputs: Sequence[str] = ("attention_mask",)) -> Adapted:
    """A Llama-style causal LM -> [TokenEmbedding, DecoderBlock x num_hidden_layers, LMHead] and its
    causal-LM loss. Refuses configurations whose forward differs from Llama's (sliding-window or
    other non-full attention layers, embedding scaling)."""
    require(model, DECODER_ATTRS, "decoder")
    side_inputs = check_side_inputs(tuple(side_inputs), "decoder")
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        raise AdapterError(f"hetpipe.adapters.decoder: config.layer_types of {type(model).__name__} holds "
                           f"{sorted(kinds - {'full_attention'})}; only full-attention decoders (Llama's mask) are "
                           "supported")
    if getattr(config, "use_sliding_window", False):
        raise AdapterError(f"hetpipe.adapters.decoder: config.use_sliding_window is set on {type(model).__name__}; "
                           "only full-attention decoders (Llama's mask) are supported")
    base = model.model
    if hasattr(base, "embed_scale") or hasattr(base, "normalizer"):
        raise AdapterError(f"hetpipe.adapters.decoder: {type(base).__name__} scales its embeddings "
                           "(embed_scale/normalizer), which Llama's forward does not")
    blocks = list(base.layers[: config.num_hidden_layers])
    layers = [TokenEmbedding(base.embed_tokens)]
    masks = CausalMasks(config)
    layers += [DecoderBlock(block, base.rotary_emb, masks, side_inputs) for block in blocks]
    layers.append(LMHead(base.norm, model.lm_head))
    names = ["embed", *(f"layers.{i}" for i in range(len(blocks))), "head"]
    return Adapted(nn.ModuleList(layers), names, CausalLMLoss(model), model)
