"""Adapters against the models themselves: the layer list run as the layer contract says (side inputs
fed per layer) equals the original model's own forward — outputs, loss and every parameter gradient,
BatchNorm running statistics too — and tied weights stay one nn.Parameter.

The reference is always an untouched deep copy of the model run through its own ``forward``; the
adapted layers hold the original's parameters, so both start from the same weights.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import SplitPoint

from hetpipe.adapters import AdapterError, adapt, decoder, gpt2, resnet, run_layers, traced, vgg

transformers = pytest.importorskip("transformers")

TOL = 1e-6


def _ids(batch: int = 3, seq: int = 12, vocab: int = 101, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _padded(ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Inputs with left padding on row 0 (the mask then matters)."""
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want[name].grad, rtol=0, atol=TOL, msg=lambda m: f"{name}: {m}")


def _assert_no_copies(model: nn.Module, layers: nn.ModuleList) -> None:
    """The layers hold exactly the model's parameter objects: none copied, none left out."""
    assert {id(p) for p in layers.parameters()} == {id(p) for p in model.parameters()}


def _check_lm(model: nn.Module, adapted, inputs, labels, seed: int = 7) -> None:
    """Train-mode forward (dropout on, same RNG stream), loss and gradients equal the model's own."""
    ref = copy.deepcopy(model)
    model.train(), ref.train()
    torch.manual_seed(seed)
    want = ref(**inputs, labels=labels)
    torch.manual_seed(seed)
    logits = run_layers(adapted.layers, inputs)
    loss = adapted.loss_fn(logits, labels)
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=TOL)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=TOL)
    loss.backward()
    want.loss.backward()
    _assert_same_grads(model, ref)


# --- Hugging Face GPT-2 ------------------------------------------------------------------------

def _gpt2(**kw) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                                  bos_token_id=0, eos_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_equals_model_with_dropout_padding_and_tied_head():
    model = _gpt2()
    adapted = adapt(model)
    assert adapted.names == ["embed", "h.0", "h.1", "h.2", "head"]
    ids = _ids()
    _check_lm(model, adapted, _padded(ids), ids)


def test_gpt2_tie_is_one_parameter_object():
    model = _gpt2()
    layers, _ = gpt2(model)
    emb, head = layers[0].wte.weight, layers[-1].lm_head.weight
    assert emb is head is model.transformer.wte.weight
    assert emb.data_ptr() == head.data_ptr()
    _assert_no_copies(model, layers)
    shared = [i for i, layer in enumerate(layers) if any(p is emb for p in layer.parameters())]
    assert shared == [0, len(layers) - 1]


def test_gpt2_position_ids_as_side_input_and_bare_token_ids():
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids()
    positions = torch.arange(3, 3 + ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    inputs = {**_padded(ids), "position_ids": positions}
    adapted = gpt2(model, side_inputs=("attention_mask", "position_ids"))
    assert all(layer.hetpipe_side_inputs == ("attention_mask", "position_ids") for layer in adapted.layers[1:-1])
    _check_lm(model, adapted, inputs, ids)
    bare = gpt2(model, side_inputs=())
    model.eval()
    torch.testing.assert_close(run_layers(bare.layers, ids), model(ids).logits, rtol=0, atol=TOL)


def test_gpt2_missing_side_input_is_named():
    layers, _ = gpt2(_gpt2())
    with pytest.raises(ValueError, match=r"layer 1 \(GPT2BlockLayer\) declares side inputs \['attention_mask'\]"):
        run_layers(layers, {"input_ids": _ids()})


def test_gpt2_cross_attention_refused():
    with pytest.raises(AdapterError, match="add_cross_attention"):
        gpt2(_gpt2(add_cross_attention=True))


def _ones(ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Inputs with a mask that masks nothing (what a batch without padding carries)."""
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_gpt2_with_a_mask_of_ones_and_positions_equals_model():
    ids = _ids(seed=3)
    model = _gpt2()
    _check_lm(model, gpt2(model), _ones(ids), ids)
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    positions = torch.arange(2, 2 + ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    _check_lm(model, gpt2(model, side_inputs=("attention_mask", "position_ids")),
              {**_ones(ids), "position_ids": positions}, ids)


def test_gpt2_blocks_are_called_by_keyword_as_transformers_4_blocks_need():
    """Blocks with the signature and return of transformers 4.x's ``GPT2Block`` (the cache, then
    ``cache_position`` before ``attention_mask``; no ``**kwargs``, so no ``position_ids``; a tuple
    back), running the real block: the adapted layers still equal the model's own forward (with its
    5.x blocks). Positional arguments would hand the mask to ``cache_position``."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    class Gpt2Block4(GPT2Block):
        def forward(self, hidden_states, past_key_value=None, cache_position=None, attention_mask=None,
                    head_mask=None, encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False,
                    output_attentions=False):
            if past_key_value is not None or cache_position is not None or head_mask is not None:
                raise TypeError("a 4.x block was given a cache, cache positions or a head mask")
            return (super().forward(hidden_states, attention_mask=attention_mask, use_cache=use_cache),)

    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model.eval()
    ids = _ids(seed=4)
    for inputs in (_padded(ids), _ones(ids)):
        want = model(**inputs).logits
        old = copy.deepcopy(model)
        for block in old.transformer.h:
            block.__class__ = Gpt2Block4
        got = run_layers(gpt2(old).layers, inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def _syncs_of_one_forward(layers, inputs) -> int:
    from host_syncs import HostSyncs
    syncs = HostSyncs()
    with syncs.recording(), torch.no_grad():
        run_layers(layers, inputs)
    return len(syncs.syncs)


def test_causal_lm_blocks_read_the_mask_once_per_forward_and_copies_start_afresh():
    """The model's blocks share one mask per forward: one host-device synchronisation (the mask's
    check for padding) for all of them, with or without padding; none without a mask. A deep copy
    (a stage's private layers) shares one builder among its blocks, not the original's."""
    import pickle

    model = _gpt2()
    ids = _ids()
    layers = gpt2(model).layers
    assert len({id(layer.masks) for layer in layers[1:-1]}) == 1
    assert [_syncs_of_one_forward(layers, x) for x in (_padded(ids), _ones(ids), _padded(ids))] == [1, 1, 1]
    assert _syncs_of_one_forward(gpt2(model, side_inputs=()).layers, ids) == 0
    assert _syncs_of_one_forward(decoder(_llama(True)).layers, _padded(_ids(seed=1))) == 1
    inputs = _padded(ids)
    _syncs_of_one_forward(layers, inputs)
    assert len(layers[1].masks._built) == 1         # the mask lives while the inputs it was built from do
    copied = copy.deepcopy(list(layers[1:3]))
    assert copied[0].masks is copied[1].masks is not layers[1].masks and not copied[0].masks._built
    del inputs
    assert not layers[1].masks._built
    restored = pickle.loads(pickle.dumps(layers[1].masks))
    assert restored.config.n_layer == model.config.n_layer and not restored._built


# --- Llama-style decoders ----------------------------------------------------------------------

def _llama(tie: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.1, tie_word_embeddings=tie, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_equals_model(tie):
    model = _llama(tie)
    adapted = adapt(model)
    assert adapted.names == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    _assert_no_copies(model, adapted.layers)
    emb, head = adapted.layers[0].embed_tokens.weight, adapted.layers[-1].lm_head.weight
    assert (emb is head) == tie and (emb.data_ptr() == head.data_ptr()) == tie
    ids = _ids(seed=1)
    _check_lm(model, adapted, _padded(ids), ids)


def test_llama_labels_with_ignored_tokens():
    model = _llama(False)
    ids = _ids(seed=2)
    labels = ids.clone()
    labels[0, :3] = -100
    _check_lm(model, decoder(model), _padded(ids), labels)


def test_decoder_with_other_attention_layers_refused():
    model = _llama(False)
    model.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(AdapterError, match="layer_types"):
        decoder(model)


# --- torchvision-style ResNet and VGG (written here after torchvision's structure) ------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, widths=(8, 16, 16, 32), blocks=(2, 1, 1, 1), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stride = 1 if i == 0 else 2
            layers = [BasicBlock(cin, w, stride)] + [BasicBlock(w, w) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class VGG(nn.Module):
    def __init__(self, cfg=(8, "M", 16, "M", 32, 32, "M"), batch_norm: bool = True, classes: int = 10) -> None:
        super().__init__()
        mods, cin = [], 3
        for v in cfg:
            if v == "M":
                mods.append(nn.MaxPool2d(2, 2))
            else:
                mods += [nn.Conv2d(cin, v, 3, padding=1)] + ([nn.BatchNorm2d(v)] if batch_norm else [])
                mods.append(nn.ReLU(inplace=True))
                cin = v
        self.features = nn.Sequential(*mods)
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(cin * 4, 64), nn.ReLU(True), nn.Dropout(0.5),
                                        nn.Linear(64, 64), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _check_classifier(model: nn.Module, make: Callable, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two train steps' outputs, gradients and BatchNorm statistics, then eval outputs, equal the model's."""
    ref = copy.deepcopy(model)
    adapted = make(model)
    _assert_no_copies(model, adapted.layers)
    for step in range(2):
        model.train(), ref.train()
        torch.manual_seed(step)
        want = ref(x)
        torch.manual_seed(step)
        got = run_layers(adapted.layers, x)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        model.zero_grad(), ref.zero_grad()
        adapted.loss_fn(got, y).backward()
        F.cross_entropy(want, y).backward()
        _assert_same_grads(model, ref)
    buffers = dict(ref.named_buffers())
    assert any("running_mean" in k for k in buffers) == any(isinstance(m, nn.BatchNorm2d) for m in ref.modules())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=0, atol=TOL, msg=lambda m: f"{name}: {m}")
    model.eval(), ref.eval()
    torch.testing.assert_close(run_layers(adapted.layers, x), ref(x), rtol=0, atol=TOL)


def _images(n: int = 6, size: int = 16):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_resnet_with_batchnorm_equals_model():
    torch.manual_seed(0)
    model = ResNet()
    adapted = adapt(model)
    assert adapted.names == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0", "head"]
    _check_classifier(model, resnet, *_images())


@pytest.mark.parametrize("batch_norm", [True, False], ids=["bn", "plain"])
def test_vgg_equals_model(batch_norm):
    torch.manual_seed(0)
    model = VGG(batch_norm=batch_norm)
    adapted = adapt(model)
    assert adapted.names == ["features.0", "features.4" if batch_norm else "features.3",
                             "features.8" if batch_norm else "features.6",
                             "features.11" if batch_norm else "features.8",
                             "classifier.0", "classifier.3", "classifier.6"]
    _check_classifier(model, vgg, *_images())


def test_resnet_without_stage_named():
    model = ResNet()
    del model.layer3
    with pytest.raises(AdapterError, match="layer3"):
        resnet(model)


def test_resnet_stage_not_sequential_named():
    model = ResNet()
    model.layer2 = nn.Identity()
    with pytest.raises(AdapterError, match=r"ResNet\.layer2"):
        resnet(model)


# --- any other module: the torch.fx split ------------------------------------------------------

class TiedSkipNet(nn.Module):
    """Neither an LM nor a vision model: skip connections across any split, BatchNorm, dropout, a
    weight tied functionally (the output projection reads the embedding's weight), two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 16)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = torch.relu(self.fc1(x))
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        y = self.norm(self.drop(self.fc2(h)) + x) * mask.unsqueeze(-1)
        return y @ self.emb.weight.t()


SPLITS = {"names": ["fc1", "norm"],
          "split-points": {"fc1": SplitPoint.END, "drop": SplitPoint.BEGINNING},
          "balanced": 3}


@pytest.mark.parametrize("how", list(SPLITS))
def test_traced_split_equals_model(how):
    torch.manual_seed(0)
    model = TiedSkipNet()
    ref = copy.deepcopy(model)
    spec = SPLITS[how]
    adapted = adapt(model, num_layers=spec) if isinstance(spec, int) else adapt(model, split_points=spec)
    assert len(adapted.layers) == 3
    _assert_no_copies(model, adapted.layers)
    holders = [i for i, layer in enumerate(adapted.layers) if any(p is model.emb.weight for p in layer.parameters())]
    assert holders[0] == 0 and holders[-1] == 2        # the tie spans the first and the last layer
    assert any(layer.hetpipe_side_inputs == ("mask",) for layer in adapted.layers[1:])
    ids = _ids(4, 8, 50)
    inputs = {"ids": ids, "mask": (ids % 3 != 0).float()}
    target = _ids(4, 8, 50, seed=5)
    for step in range(2):
        torch.manual_seed(step)
        want = ref(**inputs)
        torch.manual_seed(step)
        got = run_layers(adapted.layers, inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        model.zero_grad(), ref.zero_grad()
        F.cross_entropy(got.flatten(0, 1), target.flatten()).backward()
        F.cross_entropy(want.flatten(0, 1), target.flatten()).backward()
        _assert_same_grads(model, ref)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=0, atol=TOL)
    model.eval(), ref.eval()
    torch.testing.assert_close(run_layers(adapted.layers, inputs), ref(**inputs), rtol=0, atol=TOL)


def test_traced_single_tensor_input_carries_skip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    layers, loss_fn = traced(model, ["2"])
    assert loss_fn is None and len(layers) == 2
    x = torch.randn(5, 8)
    torch.testing.assert_close(run_layers(layers, x), model(x), rtol=0, atol=0)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.branchy, self.post = nn.Linear(4, 4), Branchy(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.branchy(self.pre(x)))


class Sizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        return self.b(self.a(x)) * n


def test_traced_errors_name_the_culprit():
    with pytest.raises(AdapterError, match="neither"):
        adapt(Wrapper())
    with pytest.raises(AdapterError, match="'nope' is not a submodule"):
        traced(Wrapper(), ["nope"])
    with pytest.raises(AdapterError, match="submodule 'branchy'"):
        traced(Wrapper(), ["post"])
    with pytest.raises(AdapterError, match="either split_points or num_layers"):
        traced(Wrapper())
    with pytest.raises(AdapterError, match="num_layers = 99"):
        traced(nn.Sequential(nn.Linear(2, 2)), num_layers=99)
    with pytest.raises(AdapterError, match="only tensors cross a stage boundary"):
        run_layers(traced(Sizes(), ["b"]).layers, torch.randn(2, 4))


def test_traced_leaf_module_keeps_untraceable_part_whole():
    torch.manual_seed(0)
    model = Wrapper()
    layers, _ = traced(model, ["post"], leaf_modules=["branchy"])
    x = torch.randn(3, 4)
    torch.testing.assert_close(run_layers(layers, x), model(x), rtol=0, atol=0)


# --- through the runtime: the single-process replay of a two-stage pipeline ---------------------

def _one_vw_two_stages(num_layers: int, cut: int):
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    stages = (StagePlan("cpu", "cpu", 0, cut, 0.0, 0.0), StagePlan("cpu", "cpu", cut, num_layers, 0.0, 0.0))
    return Plan(num_layers, 1, 0, "manual", (VirtualWorkerPlan(0, stages),),
                (ShardPlan(0, "n0", tuple(range(num_layers))),))


def _replay_equals_plain(model: nn.Module, adapted, step_loss: Callable, data, cut: int, loss_fn=None) -> None:
    """Trainer.replay of one VW, Nm = 1, D = 0, cut at ``cut``, equals plain SGD on an untouched copy:
    every minibatch's loss, the final weights (a tie cut across the stages must stay one weight) and
    BatchNorm's running statistics, all loaded back into the model."""
    from hetpipe import Trainer

    ref = copy.deepcopy(model)
    opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)     # noqa: E731
    plan = _one_vw_two_stages(len(adapted.layers), cut)
    got = Trainer(adapted.layers, loss_fn or adapted.loss_fn, opt, data, plan=plan).replay().losses[0]
    ref_opt = opt(ref.parameters())
    want = []
    for inputs, target in data:
        ref_opt.zero_grad()
        loss = step_loss(ref, inputs, target)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    assert [got[i] for i in range(len(data))] == pytest.approx(want, abs=1e-5, rel=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        if b.is_floating_point():
            torch.testing.assert_close(b, c, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_gpt2_through_replay_tie_cut_across_stages():
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    data = [(_padded(ids), ids) for ids in (_ids(seed=s) for s in range(4))]
    adapted = gpt2(model)
    assert adapted.layers[-1].lm_head.weight is model.transformer.wte.weight
    _replay_equals_plain(model, adapted, lambda m, x, y: m(**x, labels=y).loss, data, cut=2)
    assert adapted.layers[-1].lm_head.weight is model.transformer.wte.weight


def test_resnet_through_replay_batchnorm_on_both_stages():
    torch.manual_seed(0)
    model = ResNet()
    x, y = _images(12)
    data = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]
    _replay_equals_plain(model, resnet(model), lambda m, a, b: F.cross_entropy(m(a), b), data, cut=3)


def test_llama_through_replay():
    model = _llama(True)
    for block in model.model.layers:
        block.self_attn.attention_dropout = 0.0
    data = [(_padded(ids), ids) for ids in (_ids(seed=s) for s in range(3))]
    _replay_equals_plain(model, decoder(model), lambda m, x, y: m(**x, labels=y).loss, data, cut=3)


def test_traced_through_replay_side_input_and_functional_tie():
    torch.manual_seed(0)
    model = TiedSkipNet()
    model.drop.p = 0.0
    adapted = traced(model, ["fc2"])
    ids = [_ids(4, 8, 50, seed=s) for s in range(3)]
    data = [({"ids": x, "mask": (x % 3 != 0).float()}, _ids(4, 8, 50, seed=10 + s)) for s, x in enumerate(ids)]
    loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())     # noqa: E731
    _replay_equals_plain(model, adapted, lambda m, x, y: loss(m(**x), y), data, cut=1, loss_fn=loss)
