"""A tiny GPT-2 (built from its config, no download) trained on the bytes of a few files of Python's
standard library, by hetpipe beside plain PyTorch (same data order, seed and optimizer).

    hetpipe launch -n 6 examples/gpt2.py            # cpu-emulated: 2 VWs x 2 stages + 2 PS shards

The adapter is the only glue: ``layers, loss_fn = adapt(model)`` gives [embeddings, blocks, final
norm + tied head] and GPT-2's own shifted cross entropy; the attention mask reaches every block as
a side input. Rank 0 prints the table at the end.
"""

from __future__ import annotations

import argparse
import copy
import sysconfig
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from compare import add_run_options, finish, run_options
from hetpipe import Trainer
from hetpipe.adapters import adapt

FILES = ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "colorsys.py", "shlex.py", "queue.py", "glob.py")


def corpus(seq: int, files: int) -> torch.Tensor:
    """Byte-level token sequences (vocabulary 256) of ``seq`` tokens from the first ``files`` FILES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / f).read_bytes() for f in FILES[:files])
    ids = torch.tensor(list(text), dtype=torch.long)
    return ids[: len(ids) // seq * seq].view(-1, seq)


def minibatches(ids: torch.Tensor, batch: int):
    """``({"input_ids", "attention_mask"}, labels)`` minibatches; labels are the ids (the loss shifts)."""
    return [({"input_ids": x, "attention_mask": torch.ones_like(x)}, x)
            for x in ids[: len(ids) // batch * batch].split(batch)]


def lm_step(model, inputs, labels):
    return model(**inputs, labels=labels).loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--files", type=int, default=4, help="how many standard-library files to train on")
    p.add_argument("--minibatches", type=int, default=48, help="training minibatches per epoch (at most)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-3)
    add_run_options(p, epochs=1)
    args = p.parse_args()

    data = minibatches(corpus(args.seq, args.files), args.batch)
    train, test = data[: min(args.minibatches, len(data) * 9 // 10)], data[len(data) * 9 // 10:]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width,
                                       n_layer=args.layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    plain_model = copy.deepcopy(model)
    optimizer = lambda params: torch.optim.Adam(params, lr=args.lr)     # noqa: E731

    layers, loss_fn = adapt(model)
    trainer = Trainer(layers, loss_fn, optimizer, train, **run_options(args))
    finish("GPT-2", trainer.fit(), model, plain_model, lm_step, optimizer, train, test, args.epochs, args.batch)


if __name__ == "__main__":
    main()
