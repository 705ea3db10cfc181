"""A GPT-2 recipe on Hugging Face's Trainer: a small GPT-2 (from its config, no download) learns the
bytes of a few files of Python's standard library. The Trainer brings what a recipe needs: a shuffled
DataLoader, AdamW without weight decay on biases and LayerNorms, warm-up + cosine, clipping,
evaluation every 8 steps with early stopping and the best model loaded at the end, TensorBoard,
checkpoints to resume from, and the model saved for `from_pretrained`. The same recipe on one process
(plain.py: `python plain.py`) and on hetpipe (train.py: `hetpipe launch -n 6 train.py`)."""
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import EarlyStoppingCallback, GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers import Trainer

SEQ = 32


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
args = TrainingArguments(output_dir="out", num_train_epochs=2, per_device_train_batch_size=8,
                         per_device_eval_batch_size=8, learning_rate=2e-3, weight_decay=0.1, warmup_steps=8,
                         lr_scheduler_type="cosine", max_grad_norm=1.0, eval_strategy="steps", eval_steps=8,
                         save_strategy="steps", save_steps=8, load_best_model_at_end=True,
                         metric_for_best_model="eval_loss", report_to="tensorboard", disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Blocks(["textwrap.py", "heapq.py", "bisect.py"]),
                  eval_dataset=Blocks(["colorsys.py"]), callbacks=[EarlyStoppingCallback(early_stopping_patience=3)])
out = trainer.train()
trainer.save_model("out/model")
if trainer.is_world_process_zero():
    print(f"trained {out.global_step} steps, mean train loss {out.training_loss:.3f}")
