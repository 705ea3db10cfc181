"""hetpipe's runtime on a real CUDA device beside plain PyTorch training on that same device.

One GPU cannot form a heterogeneous cluster, so this measures what the runtime costs on real
hardware rather than what heterogeneity gains (bench/e2e does that, emulated). The model is a
GPT-2-small-like decoder built from its config (Hugging Face ``GPT2LMHeadModel``: 12 blocks, width
768, 12 heads, sequence 1024, vocabulary 50257), cut by ``hetpipe.adapters.adapt`` and trained in
bf16 (autocast, float32 master weights) with AdamW:

* plain PyTorch: one process trains the model on the device (``model(**inputs, labels=ids).loss``
  under ``torch.autocast``), the same minibatches in the same order, the same optimizer;
* hetpipe: one VW whose 2 stages are 2 ranks sharing the device, plus 1 PS rank (host memory, WSP
  pushes and pulls every wave), ``Trainer(precision="bf16")``, for each staleness bound D asked for.

Throughput is taken in steady state: the first ``--warmup-waves`` waves (``nm`` minibatches each) are
left out of both (hetpipe's wave times come from its metrics file); the whole-run figure, start-up
included, is printed beside it. The ideal ratio is 1.0: the GPU does the same arithmetic either way.

The second table sets the planner's memory model (``hetpipe.plan.stage_cost``: weights, gradients,
optimizer state, weight stashes, wave deltas, activations and workspace of each stage) against the
peak each stage rank really allocated (``torch.cuda.max_memory_allocated``), for a profile of the same
layers measured on the device under autocast (``profile_model(..., precision="bf16")``).

    python bench/gpu_runtime.py --out out/gpu --head both          # needs a CUDA device and mpiexec
    python bench/gpu_runtime.py --device cpu --tiny --out /tmp/g    # smoke run of the same code on the CPU

The third table is each stage's time breakdown in the hetpipe runs (``hetpipe.schedule.trace.
time_breakdown`` of the run's trace: compute, blocked on receives and on pulls, sends, pushes, the
final sync), on the host's clock.

Everything lands in ``--out``: ``gpu_runtime.json`` (every figure, per rank) and ``gpu_runtime.txt``
(the tables printed here), both rewritten as each child run finishes, so a run stopped early keeps
the figures of the runs that finished. ``--budget`` bounds the whole benchmark: a child starts only
while time is left and gets no more than what is left, and the runs it leaves out are recorded as
skipped. On a GPU the children run with ``HETPIPE_REQUIRE_PINNED=1``: a stage whose pinned pool is
pageable fails instead of being timed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetpipe.job.procs import environment_marker, processes_with, send
from hetpipe.launch.mpiexec import mpiexec_path
from hetpipe.transport.slots import REQUIRE_PINNED_ENV
from hetpipe import Reporting

GOAL_RATIO = 0.85
GOAL_MEMORY_ERROR = 0.10
RESULT = "RESULT "
JOB_ENV = "HETPIPE_BENCH_JOB"          # marks every process of one child run (see child())


# --- the workload (the same in every process) ----------------------------------------------------

def gpt2(args, tied: bool):
    """The decoder, seeded: every process builds identical initial weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def minibatches(args) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    """``({"input_ids", "attention_mask"}, labels)`` minibatches of random tokens (the loss shifts)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.minibatches):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuts(num_layers: int, stages: int) -> List[int]:
    return [round(num_layers * k / stages) for k in range(stages + 1)]


def emit(payload: Dict[str, Any]) -> None:
    print(RESULT + json.dumps(payload), flush=True)


# --- child processes ---------------------------------------------------------------------------------

def _loss_against(loss_fn, y):
    """``loss_fn`` of an output against the labels ``y``: a closure over these arguments only, so the
    caller may drop its own names for them (and their device memory) once the profile is taken."""
    return lambda out: loss_fn(out, y)


def role_plain(args, tied: bool) -> None:
    """The profile of the adapted layers on the device, then plain PyTorch training; prints one RESULT."""
    from hetpipe.adapters import adapt
    from hetpipe.model.measure import profile_model

    device = torch.device(args.device)
    data = minibatches(args)
    model = gpt2(args, tied).to(device)
    layers, loss_fn = adapt(model)
    x, y = to_device(data[0][0], device), data[0][1].to(device)
    profile = profile_model(layers, x, "cpu-emulated", loss_fn=_loss_against(loss_fn, y), repeats=2,
                            optimizer_factor=2.0, name="gpt2", precision=args.precision)
    del model, layers, loss_fn, x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    model = gpt2(args, tied).to(device)
    model.train()
    opt = adamw(model.parameters())
    warm = args.warmup_waves * args.nm
    losses = []
    synchronize(device)
    start = time.perf_counter()
    steady = start
    for k, (inputs, labels) in enumerate(data):
        if k == warm:
            synchronize(device)
            steady = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast(device, args.precision):
            loss = model(**to_device(inputs, device), labels=labels.to(device)).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    synchronize(device)
    end = time.perf_counter()
    tokens = args.batch * args.seq
    emit({"profile": profile.to_dict(),
          "tokens_per_s": (len(data) - warm) * tokens / (end - steady),
          "whole_tokens_per_s": len(data) * tokens / (end - start),
          "elapsed_s": end - start,
          "losses": [float(v) for v in losses],
          "max_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
          "params": sum(p.numel() for p in model.parameters())})


def to_device(inputs: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in inputs.items()}


def plan_for(args, num_layers: int, d: int):
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    c = cuts(num_layers, args.stages)
    stages = tuple(StagePlan(args.device, "real", a, b, 0.0, 0.0) for a, b in zip(c, c[1:]))
    return Plan(num_layers, args.nm, d, "manual", (VirtualWorkerPlan(0, stages),),
                (ShardPlan(0, "n0", tuple(range(num_layers))),), precision=args.precision)


def role_hetpipe(args, tied: bool, d: int, metrics: str) -> None:
    """One rank of the hetpipe run (under mpiexec); rank 0 prints every rank's figures, with each stage's
    time breakdown from the run's trace."""
    from mpi4py import MPI

    from hetpipe.adapters import adapt
    from hetpipe.run.trainer import Trainer
    from hetpipe.schedule.trace import time_breakdown
    import hetpipe_core

    layers, loss_fn = adapt(gpt2(args, tied))
    plan = plan_for(args, len(layers), d)
    trace = str(Path(metrics).with_suffix(".trace.json"))
    run = Trainer(layers, loss_fn, adamw, minibatches(args), plan=plan, epochs=1,
                  reporting=Reporting(progress=False, metrics=metrics, trace=trace)).fit()
    stage_ranks = {plan.rank_of(0, s): s for s in range(args.stages)}
    mine: Dict[str, Any] = {"rank": run.rank, "role": run.role, "pid": os.getpid(),
                            "stage": stage_ranks.get(run.rank),
                            "torch_cuda_initialized": torch.cuda.is_initialized()}
    if hetpipe_core.build_info()["cuda_available"]:
        mine["cuda_contexts"] = [hetpipe_core.cuda_context_active(i)
                                 for i in range(hetpipe_core.build_info()["cuda_device_count"])]
    if run.rank in stage_ranks and args.device.startswith("cuda"):
        mine["max_allocated"] = torch.cuda.max_memory_allocated(torch.device(args.device))
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if run.rank == 0:
        emit({"ranks": everyone, "transport": run.transport, "elapsed_s": run.elapsed_s, "samples": run.samples,
              "losses": [run.losses[0][p] for p in sorted(run.losses[0])],
              "breakdown": [time_breakdown(run.trace, 0, s) for s in range(args.stages)]})


# --- the parent: runs the children, compares, writes the tables ------------------------------------

class ChildFailed(RuntimeError):
    """A child process (plain PyTorch or a hetpipe run) failed or ran out of time."""


def child(cmd: Sequence[str], timeout: float, what: str, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The RESULT of ``cmd`` (with ``env`` added to this environment). Past ``timeout`` every process of
    it is killed, found by a marker in its environment (MPICH gives each rank a session of its own:
    killing mpiexec alone would leave ranks holding the device)."""
    job = uuid.uuid4().hex
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {}), JOB_ENV: job})
    except subprocess.TimeoutExpired as e:
        for pid in processes_with(environment_marker(JOB_ENV, job), exclude=[os.getpid()]):
            send(pid, signal.SIGKILL)
        raise ChildFailed(f"{what} did not finish within {timeout:.0f} s:\n{_tail(e.stdout)}\n{_tail(e.stderr)}") from None
    found = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not found:
        raise ChildFailed(f"{what} failed (exit {proc.returncode}):\n{_tail(proc.stdout)}\n{_tail(proc.stderr)}")
    return found[0]


def _tail(text: Any, n: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def steady_rate(metrics: Path, args) -> Tuple[float, float]:
    """(steady-state, whole-run) tokens/s of a hetpipe run from its metrics file: the waves after the
    first ``warmup_waves``, timed from the end of the last warm-up wave to the end of the last wave."""
    waves = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "wave"]
    summary = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "summary"]
    tokens = args.batch * args.seq
    k = args.warmup_waves
    if len(waves) <= k:
        raise SystemExit(f"gpu_runtime: {len(waves)} waves, fewer than the {k} warm-up waves + 1: "
                         "raise --minibatches or lower --warmup-waves")
    done = min(len(waves) * args.nm, args.minibatches)
    steady = (done - k * args.nm) * tokens / (waves[-1]["time_s"] - (waves[k - 1]["time_s"] if k else 0.0))
    whole = summary[-1]["samples"] * args.seq / summary[-1]["elapsed_s"] if summary else float("nan")
    return steady, whole


def planned_memory(profile_dict: Dict[str, Any], args, d: int) -> List[int]:
    """The planner's memory (bytes) of each stage of :func:`plan_for` at staleness bound ``d``."""
    from hetpipe.plan.profile import ModelProfile
    from hetpipe.plan.stage_cost import LayerTable, StageDevice

    profile = ModelProfile.from_dict(profile_dict)
    kind = profile.device_types[0]
    table = LayerTable(profile, [kind], d)
    slot = StageDevice(args.device, kind, "n0", 1 << 62)
    c = cuts(profile.num_layers, args.stages)
    return [table.stage(slot, k, args.stages, args.nm, a, b, None, None, False)[1]
            for k, (a, b) in enumerate(zip(c, c[1:]))]


class Budget:
    """The benchmark's time: a child starts only while some is left, and gets at most what is left."""

    def __init__(self, seconds: Optional[float], per_child: float) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds
        self.per_child = per_child

    def timeout(self) -> Optional[float]:
        """The next child's time limit; None when too little is left to start one (under 30 s)."""
        if self.end is None:
            return self.per_child
        left = self.end - time.monotonic()
        return min(self.per_child, left) if left >= 30 else None


def run_variant(args, tied: bool, tmp: Path, budget: Budget, out: Dict[str, Any],
                written: Callable[[], None]) -> None:
    """Plain PyTorch, then hetpipe at each D, for one head variant, into ``out``; ``written()`` after each
    run. A failed run is recorded (its ``error``) and the others still run, so that one failure leaves
    the rest of the figures; a run the budget leaves no time for is recorded as skipped."""
    here = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    name = "tied" if tied else "untied"
    env = {REQUIRE_PINNED_ENV: "1"} if args.device.startswith("cuda") else {}
    out.update({"tied_head": tied, "hetpipe": {}})
    timeout = budget.timeout()
    if timeout is None:
        out["error"] = out["skipped"] = "plain PyTorch: no time left in the budget"
        written()
        return
    try:
        out["plain"] = child([*here, "--role", "plain", "--variant", name], timeout, f"plain PyTorch ({name})", env)
    except ChildFailed as e:
        out["error"] = str(e)
        print(f"gpu_runtime: {e}", file=sys.stderr, flush=True)
        written()
        return
    written()
    for d in args.d_values:
        metrics = tmp / f"metrics-{name}-d{d}.jsonl"
        cmd = [mpiexec_path(), "-n", str(args.stages + 1), *here, "--role", "hetpipe", "--variant", name,
               "--worker-d", str(d), "--metrics", str(metrics)]
        timeout = budget.timeout()
        if timeout is None:
            out["hetpipe"][str(d)] = {"error": "no time left in the budget", "skipped": True}
            written()
            continue
        try:
            run = child(cmd, timeout, f"hetpipe D={d} ({name})", env)
        except ChildFailed as e:
            out["hetpipe"][str(d)] = {"error": str(e)}
            print(f"gpu_runtime: {e}", file=sys.stderr, flush=True)
            written()
            continue
        run["tokens_per_s"], run["whole_tokens_per_s"] = steady_rate(metrics, args)
        run["planned_memory"] = planned_memory(out["plain"]["profile"], args, d)
        out["hetpipe"][str(d)] = run
        written()


def mib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _failed(run: Dict[str, Any]) -> str:
    return "SKIPPED (no time left in --budget)" if run.get("skipped") else "FAILED (gpu_runtime.json: error)"


def tables(report: Dict[str, Any], args) -> str:
    lines = [f"hetpipe runtime vs plain PyTorch on one device; devices: real, {report['device_name']}",
             f"GPT-2 decoder {args.layers} x {args.width}, {args.heads} heads, sequence {args.seq}, vocabulary "
             f"{args.vocab}; {args.precision} ({'autocast, float32 master weights' if args.precision == 'bf16' else 'float32'}); "
             f"AdamW; minibatch {args.batch} sequences ({args.batch * args.seq} tokens); {args.minibatches} "
             f"minibatches, the first {args.warmup_waves * args.nm} ({args.warmup_waves} waves of nm={args.nm}) "
             f"left out as warm-up",
             f"hetpipe: 1 VW x {args.stages} stages (one rank each) sharing the device + 1 PS rank (host); torch "
             f"{torch.__version__}", ""]
    head = f"{'system':<34}{'tokens/s':>12}{'vs plain':>10}{'whole run tok/s':>17}{'transport':>12}"
    lines += [head, "-" * len(head)]
    for v in report["variants"]:
        label = "tied head" if v["tied_head"] else "untied head"
        if "plain" not in v:
            lines.append(f"{'plain PyTorch, ' + label:<34}  {_failed(v)}")
            continue
        base = v["plain"]["tokens_per_s"]
        lines.append(f"{'plain PyTorch, ' + label:<34}{base:>12.0f}{1.0:>9.2f}x{v['plain']['whole_tokens_per_s']:>17.0f}"
                     f"{'-':>12}")
        best = None
        for d, run in v["hetpipe"].items():
            if "error" in run:
                lines.append(f"{'hetpipe D=' + d + ', ' + label:<34}  {_failed(run)}")
                continue
            ratio = run["tokens_per_s"] / base
            best = ratio if best is None else max(best, ratio)
            lines.append(f"{'hetpipe D=' + d + ', ' + label:<34}{run['tokens_per_s']:>12.0f}{ratio:>9.2f}x"
                         f"{run['whole_tokens_per_s']:>17.0f}{run['transport']:>12}")
        if best is not None:
            lines.append(f"{'':<4}goal: hetpipe >= {GOAL_RATIO:.2f}x plain PyTorch -> "
                         f"{'met' if best >= GOAL_RATIO else 'not met'} (best {best:.2f}x)")
    lines += ["", "planner memory model vs torch.cuda.max_memory_allocated, per stage rank (MiB)"]
    head = f"{'run':<30}{'stage':>6}{'layers':>10}{'planned':>10}{'measured':>10}{'error':>9}"
    lines += [head, "-" * len(head)]
    for v in report["variants"]:
        label = "tied" if v["tied_head"] else "untied"
        worst = None
        for d, run in v["hetpipe"].items():
            if "error" in run:
                continue
            c = cuts(len(v["plain"]["profile"]["layers"]), args.stages)
            measured = {r["stage"]: r.get("max_allocated") for r in run["ranks"] if r["stage"] is not None}
            for k, planned in enumerate(run["planned_memory"]):
                m = measured.get(k)
                err = "n/a" if not m else f"{(planned - m) / m:+.1%}"
                if m:
                    worst = max(worst or 0.0, abs(planned - m) / m)
                lines.append(f"{'hetpipe D=' + d + ', ' + label:<30}{k:>6}{f'[{c[k]}, {c[k + 1]})':>10}"
                             f"{mib(planned):>10}{mib(m):>10}{err:>9}")
        if worst is not None:
            lines.append(f"{'':<4}goal ({label}): |error| <= {GOAL_MEMORY_ERROR:.0%} -> "
                         f"{'met' if worst <= GOAL_MEMORY_ERROR else 'not met'} (worst {worst:.1%})")
    ps = [r for v in report["variants"] for run in v["hetpipe"].values() for r in run.get("ranks", [])
          if r["stage"] is None]
    if report["real"] and ps:
        clean = all(not r["torch_cuda_initialized"] and not any(r.get("cuda_contexts", [])) for r in ps)
        lines.append(f"PS ranks: torch CUDA state and CUDA contexts: {'none' if clean else 'PRESENT'} ({len(ps)} ranks)")
    lines += ["", "where each stage's time went in the hetpipe runs (host clock, seconds; trace.time_breakdown)"]
    cols = ("compute", "blocked_recv", "recv", "blocked_pull", "pull", "push", "send", "sync", "startup", "other")
    head = f"{'run':<30}{'stage':>6}" + "".join(f"{c:>13}" for c in cols) + f"{'total':>9}"
    lines += [head, "-" * len(head)]
    for v in report["variants"]:
        label = "tied" if v["tied_head"] else "untied"
        for d, run in v["hetpipe"].items():
            for k, b in enumerate(run.get("breakdown", [])):
                lines.append(f"{'hetpipe D=' + d + ', ' + label:<30}{k:>6}" + "".join(f"{b[c]:>13.3f}" for c in cols)
                             + f"{b['total']:>9.2f}")
    return "\n".join(lines)


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default="out/gpu_runtime", help="folder for gpu_runtime.json and .txt")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny decoder (2 x 64, sequence 32, vocabulary 256, 12 minibatches): the smoke run")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8, help="sequences per minibatch")
    ap.add_argument("--minibatches", type=int, default=48)
    ap.add_argument("--nm", type=int, default=4, help="minibatches in flight per VW (a wave)")
    ap.add_argument("--warmup-waves", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--d", default="0,1", help="staleness bounds to run, comma separated")
    ap.add_argument("--head", choices=("tied", "untied", "both"), default="tied",
                    help="GPT-2 ties its LM head to the token embedding; 'untied' gives the head its own weight")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for each child process")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole benchmark: no child starts after it, none runs past it")
    ap.add_argument("--role", choices=("plain", "hetpipe"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=("tied", "untied"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-d", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--metrics", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.vocab = 2, 64, 4, 32, 256
        args.batch, args.minibatches, args.nm, args.warmup_waves = 4, 12, 2, 1
    args.d_values = [int(x) for x in args.d.split(",")]
    if args.minibatches < (args.warmup_waves + 1) * args.nm:
        ap.error(f"--minibatches {args.minibatches} leaves no wave after {args.warmup_waves} warm-up waves of nm={args.nm}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse(argv)
    if args.role == "plain":
        role_plain(args, args.variant == "tied")
        return
    if args.role == "hetpipe":
        role_hetpipe(args, args.variant == "tied", args.worker_d, args.metrics)
        return
    real = args.device.startswith("cuda")
    if real and not torch.cuda.is_available():
        raise SystemExit("gpu_runtime: no CUDA device (run with --device cpu --tiny for a smoke run)")
    # The parent opens no context: the children own the device one after the other.
    name = (subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                           capture_output=True, text=True, check=True).stdout.strip()
            if real else "CPU (smoke run, not a GPU figure)")
    report: Dict[str, Any] = {"device_name": name, "real": real, "torch": torch.__version__,
                              "args": {k: v for k, v in vars(args).items() if k not in ("role", "variant", "worker_d", "metrics")},
                              "goals": {"ratio": GOAL_RATIO, "memory_error": GOAL_MEMORY_ERROR}, "variants": []}
    heads = {"tied": [True], "untied": [False], "both": [True, False]}[args.head]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def written() -> None:
        """The report so far, in both files (renamed into place: a reader never sees half of one)."""
        for name, text in (("gpu_runtime.json", json.dumps(report, indent=1)), ("gpu_runtime.txt", tables(report, args))):
            tmp_file = out / f".{name}.tmp"
            tmp_file.write_text(text + "\n")
            os.replace(tmp_file, out / name)

    budget = Budget(args.budget, args.timeout)
    with tempfile.TemporaryDirectory(prefix="gpu-runtime-") as tmp:
        for tied in heads:
            report["variants"].append({})
            run_variant(args, tied, Path(tmp), budget, report["variants"][-1], written)
    written()
    text = tables(report, args)
    print(text, flush=True)
    print(f"written: {out / 'gpu_runtime.json'}, {out / 'gpu_runtime.txt'}", flush=True)
    if any("error" in v or any("error" in run for run in v["hetpipe"].values()) for v in report["variants"]):
        raise SystemExit("gpu_runtime: some runs failed (their errors are in gpu_runtime.json)")


if __name__ == "__main__":
    main()
