"""The convergence task: a small byte-level GPT trained on the text of Python's own standard library.

No download: the corpus is the standard library's top-level ``.py`` files (``sysconfig``'s ``stdlib``
path), sorted by name; every ``val_every``-th file is held out for validation, the others are
training text. The model is an ``nn.Sequential`` of plain-tensor boundaries — token + position
embedding, ``blocks`` pre-norm transformer blocks (each as two layers, attention and MLP; the causal
mask built inside each attention), final norm and byte head — so hetpipe's planner, the pipelining
baseline and DDP all cut or replicate the same list.

Every system reads one stream of minibatches: minibatch ``i`` of seed ``s`` is ``minibatch`` random
windows of the training text drawn from a generator seeded by ``(s, i)``. DDP rank ``r`` of step
``k`` takes minibatch ``k * world + r``, pipelining's step ``k`` micro-batch ``j`` takes
``k * micro + j``, and hetpipe's VW ``v`` takes minibatches ``i = v (mod VWs)``: the same samples in
the same order, whatever the system.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of the corpus, model and minibatch (the unit every profiled time refers to)."""

    context: int = 32            # tokens per training window
    width: int = 48              # model width
    heads: int = 4
    blocks: int = 6
    minibatch: int = 4           # windows per minibatch
    train_bytes: int = 4 << 20   # at most this much training text
    val_every: int = 10          # every val_every-th stdlib file is validation text
    val_windows: int = 256       # validation windows (non-overlapping, from the start of the held-out text)

    def to_dict(self) -> dict:
        return asdict(self)


# ``--task`` of run.py: the default task, and a wider, deeper GPT of about 2.05M parameters (22 layers).
PRESETS: Dict[str, TaskSpec] = {"small": TaskSpec(), "large": TaskSpec(width=128, blocks=10)}


# --- corpus ------------------------------------------------------------------------------------------

def stdlib_files() -> List[Path]:
    """The standard library's top-level .py files, sorted by name (the deterministic file choice)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if len(files) < 20:
        raise RuntimeError(f"convergence task: only {len(files)} .py files in the standard library at {root}")
    return files


def corpus(spec: TaskSpec) -> Tuple[np.ndarray, np.ndarray, Dict[str, object]]:
    """(training bytes, validation bytes, a description): uint8 arrays of the stdlib text split by file."""
    train: List[bytes] = []
    val: List[bytes] = []
    size = 0
    files = stdlib_files()
    for k, path in enumerate(files):
        text = path.read_bytes()
        if k % spec.val_every == spec.val_every - 1:
            val.append(text)
        elif size < spec.train_bytes:
            train.append(text)
            size += len(text)
    tr = np.frombuffer(b"".join(train), dtype=np.uint8)[:spec.train_bytes]
    va = np.frombuffer(b"".join(val), dtype=np.uint8)
    need = spec.val_windows * spec.context + 1
    if len(va) < need:
        raise RuntimeError(f"convergence task: {len(va)} validation bytes, {need} needed for "
                           f"{spec.val_windows} windows of {spec.context}")
    about = {"stdlib": str(Path(sysconfig.get_paths()["stdlib"]).name), "files": len(files),
             "train_bytes": int(len(tr)), "val_bytes": int(len(va)), "train_files": len(train), "val_files": len(val)}
    return tr, va, about


def window_batch(text: np.ndarray, starts: np.ndarray, context: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte labels (int64, ``[len(starts), context]``) of the windows at ``starts``."""
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    w = torch.from_numpy(text[idx].astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class MinibatchStream:
    """Minibatches ``[0, count)`` of one seed's stream (see the module docstring); re-iterable, indexable."""

    def __init__(self, text: np.ndarray, spec: TaskSpec, seed: int, count: int) -> None:
        self.text, self.spec, self.seed, self.count = text, spec, seed, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, i])
        starts = rng.integers(0, len(self.text) - self.spec.context - 1, size=self.spec.minibatch)
        return window_batch(self.text, starts, self.spec.context)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return (self[i] for i in range(self.count))

    def concat(self, first: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Minibatches ``first .. first + n - 1`` as one batch (in order)."""
        parts = [self[first + k] for k in range(n)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def windows(self, first: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Windows ``first .. first + n - 1`` of the stream read window by window (window ``j`` is window
        ``j mod minibatch`` of minibatch ``j // minibatch``), as one batch: a share of a step that need not
        be whole minibatches."""
        mb = self.spec.minibatch
        lo, hi = first // mb, (first + n - 1) // mb
        x, y = self.concat(lo, hi - lo + 1)
        off = first - lo * mb
        return x[off:off + n], y[off:off + n]


def validation_set(val: np.ndarray, spec: TaskSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fixed validation windows: consecutive, non-overlapping, from the start of the held-out text."""
    starts = np.arange(spec.val_windows) * spec.context
    return window_batch(val, starts, spec.context)


# --- model -------------------------------------------------------------------------------------------

class Embed(nn.Module):
    """Token ids ``[B, T]`` (int64) -> token plus learned position embedding ``[B, T, C]``."""

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, spec.width)
        self.pos = nn.Parameter(torch.randn(spec.context, spec.width) * 0.02)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Attention(nn.Module):
    """Pre-norm causal multi-head self-attention with its residual: ``x + proj(attn(ln(x)))``."""

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__()
        if spec.width % spec.heads:
            raise ValueError(f"convergence task: width {spec.width} is not a multiple of heads {spec.heads}")
        self.heads = spec.heads
        self.ln = nn.LayerNorm(spec.width)
        self.qkv = nn.Linear(spec.width, 3 * spec.width)
        self.proj = nn.Linear(spec.width, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # The causal mask is built here, per call (no buffer: hetpipe's stages hold parameters only).
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Pre-norm 4x MLP with its residual: ``x + mlp(ln(x))``."""

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(spec.width)
        self.mlp = nn.Sequential(nn.Linear(spec.width, 4 * spec.width), nn.GELU(), nn.Linear(4 * spec.width, spec.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class Head(nn.Module):
    """Final norm and the byte logits ``[B, T, 256]``."""

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(spec.width)
        self.out = nn.Linear(spec.width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_layers(spec: TaskSpec, seed: int) -> List[nn.Module]:
    """The model as its ordered layers, identical for a given ``seed`` (the global RNG is left untouched).

    Each transformer block is two layers, its attention and its MLP half (each with its residual), so
    that a partitioner can cut inside a block."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [Embed(spec), *[part for _ in range(spec.blocks) for part in (Attention(spec), MLP(spec))], Head(spec)]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def optimizer(params, lr: float) -> torch.optim.Optimizer:
    """Every system's optimizer: Adam (PyTorch defaults besides the learning rate)."""
    return torch.optim.Adam(params, lr=lr)


@torch.no_grad()
def evaluate(layers: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, chunk: int = 64) -> float:
    """Mean validation loss (nats per byte) of ``layers`` on windows ``x``, labels ``y``."""
    model = nn.Sequential(*layers).eval()
    total = 0.0
    for i in range(0, len(x), chunk):
        out = model(x[i:i + chunk])
        total += float(F.cross_entropy(out.reshape(-1, VOCAB), y[i:i + chunk].reshape(-1), reduction="sum"))
    return total / y.numel()


def uniform_loss() -> float:
    """The loss of a uniform guess over bytes, ln 256: where every run starts from."""
    return math.log(VOCAB)
