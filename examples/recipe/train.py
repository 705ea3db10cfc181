"""A GPT-2 recipe: a small GPT-2 (from its config, no download) learns the bytes of a few files
of Python's standard library, with a shuffled DataLoader of Hugging Face-style samples, AdamW without
weight decay on biases and LayerNorms, warm-up + cosine, clipping, evaluation every 8 steps with early
stopping, TensorBoard, a checkpoint to resume from, and the model saved for `from_pretrained`. The
same recipe in plain PyTorch (plain.py) and on hetpipe (train.py: `hetpipe launch -n 6 train.py`)."""
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup
import hetpipe

EPOCHS, SEQ = 2, 32


class Blocks(Dataset):
    """Blocks of SEQ bytes of standard-library files, as {"input_ids", "attention_mask", "labels"}."""

    def __init__(self, files):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        data = torch.tensor(list(b"".join((stdlib / f).read_bytes() for f in files)))
        self.blocks = data[: len(data) // SEQ * SEQ].view(-1, SEQ)[:256]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        x = self.blocks[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
train = DataLoader(Blocks(["textwrap.py", "heapq.py", "bisect.py"]), batch_size=8, shuffle=True)
val = DataLoader(Blocks(["colorsys.py"]), batch_size=8)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=2e-3)


def schedule(opt):
    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=8, num_training_steps=EPOCHS * len(train))


result = hetpipe.Trainer(model, None, optimizer, train, epochs=EPOCHS,
                         numerics=hetpipe.Numerics(clip_grad_norm=1.0, lr_scheduler=schedule),
                         checkpointing=hetpipe.Checkpointing(dir="out/ckpt"),
                         reporting=hetpipe.Reporting(tensorboard="out/tb", metrics="out/metrics.jsonl", eval_data=val,
                                                     eval_every_steps=8, callbacks=[hetpipe.EarlyStopping(patience=3)])
                         ).fit()
if result.rank == 0:
    model.save_pretrained("out/model")
    print(f"last loss {result.final_loss():.3f}")
