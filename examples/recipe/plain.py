"""A GPT-2 recipe: a small GPT-2 (from its config, no download) learns the bytes of a few files
of Python's standard library, with a shuffled DataLoader of Hugging Face-style samples, AdamW without
weight decay on biases and LayerNorms, warm-up + cosine, clipping, evaluation every 8 steps with early
stopping, TensorBoard, a checkpoint to resume from, and the model saved for `from_pretrained`. The
same recipe in plain PyTorch (plain.py) and on hetpipe (train.py: `hetpipe launch -n 6 train.py`)."""
import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

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


scheduler = schedule(optimizer)
writer = SummaryWriter("out/tb")
step, best, bad = 0, float("inf"), 0
if os.path.exists("out/ckpt.pt"):
    saved = torch.load("out/ckpt.pt")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    step, best, bad = saved["step"], saved["best"], saved["bad"]
for epoch in range(step // len(train), EPOCHS):
    torch.manual_seed(epoch)
    for i, batch in enumerate(train):
        if epoch * len(train) + i < step:
            continue
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        writer.add_scalar("train/loss", loss.item(), step)
        if step % 8 == 0:
            model.eval()
            with torch.no_grad():
                val_loss = sum(model(**b).loss.item() for b in val) / len(val)
            model.train()
            writer.add_scalar("eval/loss", val_loss, step)
            best, bad = (val_loss, 0) if val_loss < best else (best, bad + 1)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "scheduler": scheduler.state_dict(), "best": best, "bad": bad}, "out/ckpt.pt")
            if bad >= 3:
                break
    if bad >= 3:
        break
model.save_pretrained("out/model")
print(f"last loss {loss.item():.3f}")
