"""Fit the planner's staleness costs on one regime's committed runs and check them on the other's.

Usage: python bench/convergence/staleness_fit.py [--results DIR] [--out FILE]

Reads the time-to-accuracy campaigns in ``bench/convergence/results`` (``tta-*.json``, written by
``tta.py``). For every hetpipe row that ran a plan under the plain update rule (``mean``, outer SGD at
lr 1, equal waves) and every target, the *residual* is what Pollux's efficiency misses:

    residual = (samples to the target / DDP's samples to it) / ((B + M) / (B + M_ddp))

with ``B`` the noise scale measured along DDP's run at that target and ``M``, ``M_ddp`` the batches per
update. :func:`hetpipe.plan.efficiency.sample_cost` models it from the plan alone (stage counts, Nm, D).
Its three coefficients are fitted by least squares on log residuals over **R2** (every device holds the
model; the 2,000-step runs) and then predicted, not refitted, for **R1** (the slow devices cannot hold
it): the out-of-sample check. Last, the R1 planner decision the campaigns ran at a noise scale of 17
windows is recomputed with the fitted costs from the committed candidate table (each candidate at the Nm
the Pollux-only search chose for it).

Everything is on the virtual clock of emulated devices (``tta.py``'s); no run is made here.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "python"))

from hetpipe.plan.efficiency import FITTED_STALENESS_COSTS, StalenessCosts, local_staleness, sample_cost  # noqa: E402

FIT_FILES = "tta-r2-2000*.json"         # the training set: R2's 2,000-step campaigns
CHECK_FILES = "tta-r1*.json"            # the check: every R1 campaign that ran a plan
DECISION_FILE = "tta-r1-200-plan-ed-noise17.json"
PLAIN = {"aggregate": "mean", "outer": "sgd", "outer_lr": 1.0, "outer_gain": "none", "outer_staleness": "none",
         "outer_delay": 0}


def observations(files: Sequence[Path]) -> List[Dict]:
    """One per (plan, target) of the plain rule; a run repeated in several files counts once."""
    seen, out = set(), []
    for f in files:
        for regime, d in json.loads(f.read_text()).items():
            if not isinstance(d, dict) or "stats" not in d:
                continue
            ddp_row = next(r for r in d["rows"] if r["key"] == "ddp-fast")
            ddp = d["stats"]["ddp-fast"]["targets"]
            for r in d["rows"]:
                p = r.get("plan")
                if r["system"] != "hetpipe" or not p or "waves" in r["key"] or r["key"] not in d["stats"]:
                    continue
                if any(p.get(k, v) != v for k, v in PLAIN.items()):
                    continue
                dm = re.search(r"-d(\d+)-", r["key"])      # the run's bound (the plan's field may be the planner's)
                run_d = int(dm.group(1)) if dm else int(p["d"])
                stages = [len(vw["stages"]) for vw in p["virtual_workers"]]
                for t, v in d["stats"][r["key"]]["targets"].items():
                    if not v.get("samples") or not ddp[t].get("samples"):
                        continue
                    samples, base = v["samples"][0], ddp[t]["samples"][0]
                    key = (regime, tuple(stages), p["nm"], run_d, round(samples, 3), round(base, 3))
                    if key in seen:
                        continue
                    seen.add(key)
                    noise = d["noise_scale"][t][0]
                    pollux = (noise + r["batch"]) / (noise + ddp_row["batch"])
                    out.append({"file": f.name, "regime": regime, "stages": stages, "nm": p["nm"], "d": run_d,
                                "target": float(t), "noise": noise, "batch": r["batch"],
                                "ddp_batch": ddp_row["batch"], "measured": samples / base, "pollux": pollux,
                                "residual": samples / base / pollux})
    return out


def fit(obs: Sequence[Dict]) -> StalenessCosts:
    """The coefficients (>= 0, three decimals) minimising the squared log error over ``obs``: a grid of
    0.01 over [0, 1], then one of 0.001 around its best."""
    logs = np.log([o["residual"] for o in obs])
    tau = np.array([local_staleness(o["stages"], o["nm"]) for o in obs])
    others = np.array([(len(o["stages"]) - 1) / len(o["stages"]) for o in obs])
    avg = others * np.sqrt([o["nm"] for o in obs])
    wsp = others * np.array([o["d"] * o["nm"] for o in obs])

    def best(grid_p, grid_a, grid_w):
        p, a, w = np.meshgrid(grid_p, grid_a, grid_w, indexing="ij")
        pred = (np.log1p(p[..., None] * tau) + np.log1p(a[..., None] * avg) + np.log1p(w[..., None] * wsp))
        err = ((pred - logs) ** 2).sum(axis=-1)
        i = np.unravel_index(np.argmin(err), err.shape)
        return grid_p[i[0]], grid_a[i[1]], grid_w[i[2]]

    coarse = np.round(np.arange(0, 1.0001, 0.01), 3)
    p0, a0, w0 = best(coarse, coarse, coarse)
    fine = [np.round(np.arange(max(c - 0.01, 0), c + 0.0101, 0.001), 3) for c in (p0, a0, w0)]
    return StalenessCosts(*(float(x) for x in best(*fine)))


def configs(obs: Sequence[Dict], costs: StalenessCosts) -> List[Tuple]:
    """Per plan shape: its observations' residuals and the fitted cost."""
    groups: Dict[Tuple, List[Dict]] = {}
    for o in obs:
        groups.setdefault((o["regime"], tuple(o["stages"]), o["nm"], o["d"]), []).append(o)
    out = []
    for (regime, stages, nm, d), os in sorted(groups.items()):
        res = [o["residual"] for o in os]
        out.append((regime, stages, nm, d, res, sample_cost(stages, nm, d, costs)))
    return out


def shape(stages: Sequence[int]) -> str:
    counts: Dict[int, int] = {}
    for s in stages:
        counts[s] = counts.get(s, 0) + 1
    return "+".join(f"{n}x{s}" for s, n in sorted(counts.items(), reverse=True))


def table(rows: List[Tuple]) -> List[str]:
    lines = [f"  {'VWs x stages':13} {'Nm':>3} {'D':>2} {'tau':>5} {'targets':>7}  {'measured residual':>24}  "
             f"{'Pollux alone':>12}  {'fitted cost':>11}",
             f"  {'-' * 13} {'-' * 3} {'-' * 2} {'-' * 5} {'-' * 7}  {'-' * 24}  {'-' * 12}  {'-' * 11}"]
    for _, stages, nm, d, res, cost in rows:
        geo = math.exp(sum(math.log(r) for r in res) / len(res))
        spread = f"{geo:.2f} ({min(res):.2f}-{max(res):.2f})"
        lines.append(f"  {shape(stages):13} {nm:3d} {d:2d} {local_staleness(stages, nm):5.2f} {len(res):7d}  "
                     f"{spread:>24}  {1.0:12.2f}  {cost:11.2f}")
    return lines


def log_error(obs: Sequence[Dict], costs: StalenessCosts) -> float:
    """The mean |log(measured residual / predicted cost)| over ``obs``, as a factor (1.0: exact)."""
    return math.exp(sum(abs(math.log(o["residual"] / sample_cost(o["stages"], o["nm"], o["d"], costs)))
                        for o in obs) / len(obs))


def decision(path: Path, costs: StalenessCosts) -> List[str]:
    """The committed R1 candidate table, goodput recomputed with ``costs`` at the run's D."""
    d = json.loads(path.read_text())["r1"]
    row = next(r for r in d["rows"] if r.get("plan"))
    tta = row["plan"]["meta"]["time_to_accuracy"]
    run_d = int(re.search(r"-d(\d+)-", row["key"]).group(1))
    lines = [f"  {path.name}: the candidates at a noise scale of {tta['noise_scale']:g} windows, D = {run_d}",
             f"  {'#':>3}  {'without':32} {'VWs':8} {'Nm':>3}  {'samples/s':>9}  {'goodput, Pollux':>15}  "
             f"{'cost':>5}  {'goodput, fitted':>15}"]
    best = {}
    for c in tta["candidates"]:
        if "goodput" not in c:
            continue
        cost = sample_cost(c["vws"], c["nm"], run_d, costs)
        fitted = c["samples_per_s"] * c["efficiency"] / cost
        for name, value in (("pollux", c["goodput"]), ("fitted", fitted)):
            if name not in best or value > best[name][1]:
                best[name] = (c["index"], value)
        lines.append(f"  {c['index']:3d}  {c['without_text'][:32]:32} {c['vws_text']:8} {c['nm']:3d}  "
                     f"{c['samples_per_s']:9.1f}  {c['goodput']:15.1f}  {cost:5.2f}  {fitted:15.1f}")
    lines.append(f"  chosen: #{best['pollux'][0]} by Pollux's goodput alone, #{best['fitted'][0]} with the fitted "
                 f"costs")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--out", type=Path, help="also write the report to this file")
    args = ap.parse_args(argv)
    train = observations(sorted(args.results.glob(FIT_FILES)))
    check = observations(sorted(args.results.glob(CHECK_FILES)))
    if not train or not check:
        raise SystemExit(f"staleness_fit: no plain-rule hetpipe plan runs in {args.results} "
                         f"({len(train)} for the fit, {len(check)} for the check)")
    costs = fit(train)
    none = StalenessCosts()
    lines = ["Staleness costs fitted on R2, checked on R1 (virtual clock, EMULATED devices; committed runs, "
             "no new run)",
             f"fit: {len(train)} (plan, target) observations of R2's 2,000-step campaigns -> {costs.text()}",
             f"the planner's FITTED_STALENESS_COSTS: {FITTED_STALENESS_COSTS.text()}",
             "", "R2 (the fit): residual = samples to target / DDP's, over Pollux's predicted ratio"]
    lines += table(configs(train, costs))
    lines += ["", "R1 (out of sample: the fitted costs predict, nothing is refitted)"]
    lines += table(configs(check, costs))
    lines += ["", f"mean |log error| as a factor: R2 {log_error(train, none):.2f}x with Pollux alone, "
                  f"{log_error(train, costs):.2f}x fitted; R1 {log_error(check, none):.2f}x with Pollux alone, "
                  f"{log_error(check, costs):.2f}x fitted", ""]
    lines += decision(args.results / DECISION_FILE, costs)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
