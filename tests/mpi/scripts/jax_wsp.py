"""A JAX MLP trained by hetpipe's JAX front end under mpiexec, and a single-process reference of the same
schedule written from the WSP specification (docs/design.md, "WSP semantics").

Usage:
    mpiexec -n 6 python jax_wsp.py run OUT D          2 VWs x 2 stages + 2 PS shards; writes OUT/run_D.json
    python jax_wsp.py reference OUT D                  writes OUT/reference_D.json (at D >= 1 it follows the
                                                       run's record: the g each pull got)

The reference shares the model's per-stage math (``hetpipe.jax.model.StageMath``: the compiled forward,
vjp and optimizer step) and the schedule's instruction streams, nothing else: it interprets the
streams in one process, keeps each stage's weight versions and wave deltas itself, and applies the
PS rule (W_{c+1} = W_c + every VW's wave-c delta, VW then stage order; a pull of wave w given g is
W_g plus the stage's own deltas of waves >= g, in wave order) in NumPy. In both modes ``import torch``
fails.
"""

import json
import os
import sys
from pathlib import Path

sys.modules["torch"] = None
# One XLA thread per process: every compiled computation is then the same sequence of float operations
# in the run's ranks and in the reference.
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hetpipe.jax as hj  # noqa: E402
from hetpipe.jax.model import FlatLayers, StageMath, jitted_step  # noqa: E402
from hetpipe.schedule.generators import hetpipe_schedule  # noqa: E402
from hetpipe.schedule.ir import Apply, Bwd, Fwd, Pull, Push, RecvAct, RecvGrad, SendAct, SendGrad  # noqa: E402

NM, LR, EPOCHS = 2, 0.05, 2


def model():
    def dense(key, n_in, n_out):
        return {"w": jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in),
                "b": jnp.zeros(n_out, jnp.float32)}

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = lambda p, x: jnp.tanh(x @ p["w"] + p["b"])   # noqa: E731
    return [hj.Layer(dense(keys[0], 8, 16), hidden, "in"), hj.Layer(dense(keys[1], 16, 16), hidden, "h1"),
            hj.Layer(dense(keys[2], 16, 16), hidden, "h2"), hj.Layer(dense(keys[3], 16, 3), lambda p, x: x @ p["w"] + p["b"], "out")]


def loss(logits, y):
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 8)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]


def plan(d: int):
    return hj.manual_plan(4, [[2], [1]], nm=NM, d=d, shards=2, aggregate="sum")


def run(out: Path, d: int) -> None:
    from mpi4py import MPI

    res = hj.train(MPI.COMM_WORLD, plan(d), model(), loss, hj.sgd(LR), batches(), epochs=EPOCHS)
    if MPI.COMM_WORLD.Get_rank() == 0:
        (out / f"run_{d}.json").write_text(json.dumps({
            "losses": {str(v): ls for v, ls in res.losses.items()},
            "weights": {str(l): w.tobytes().hex() for l, w in res.weights.items()},
            "pulls": [[*k, {str(s): g for s, g in v.items()}] for k, v in sorted(res.pulls.items())],
            "plane": res.ps_plane, "torch": sys.modules.get("torch") is not None}))
        print("RESULT " + json.dumps({"mode": "run", "d": d}), flush=True)


def reference(out: Path, d: int) -> None:
    p = plan(d)
    flat = FlatLayers(model())
    data = [list(batches()[v::2][:len(batches()) // 2]) * EPOCHS for v in range(2)]
    recorded = {}
    if d > 0:
        for v, s, w, gs in json.loads((out / f"run_{d}.json").read_text())["pulls"]:
            recorded[(v, s, w)] = {int(k): g for k, g in gs.items()}
    owner = {l: sh.index for sh in p.ps_shards for l in sh.layers}
    history = [[v.copy() for v in flat.vectors]]            # history[g][l]: the global weights W_g
    pushed = {}                                             # wave -> {(vw, stage): per-layer delta}
    stages, mail, losses = {}, {}, {0: [], 1: []}
    step = jitted_step(hj.sgd(LR))
    for vw in p.virtual_workers:
        n = len(vw.stages)
        streams = hetpipe_schedule(n, len(data[vw.index]), NM, d).streams
        for s, st in enumerate(vw.stages):
            math = StageMath(flat, st.start, st.stop, loss if s == n - 1 else None, input_grad=s > 0)
            w = jnp.asarray(np.concatenate(flat.vectors[st.start:st.stop]))
            stages[(vw.index, s)] = {"stream": list(streams[s]), "pc": 0, "math": math, "w": w, "opt": (),
                                     "last": s == n - 1, "st": st, "stash": {}, "gw": {}, "deltas": {}}

    def layer_span(st, l):
        a = sum(flat.sizes[st.start:l])
        return a, a + flat.sizes[l]

    def ready(key, i) -> bool:
        vw, s = key
        if isinstance(i, RecvAct):
            return ("act", vw, s, i.mb) in mail
        if isinstance(i, RecvGrad):
            return ("grad", vw, s, i.mb) in mail
        if isinstance(i, Pull):
            g = recorded.get((vw, s, i.wave)) or {k: i.wave - d for k in range(len(p.ps_shards))}
            return all(len(history) > gk for gk in g.values())
        return True

    def execute(key, i) -> None:
        vw, s = key
        me = stages[key]
        x_y = data[vw]
        if isinstance(i, Fwd):
            x = jnp.asarray(x_y[i.mb][0]) if s == 0 else mail.pop(("act", vw, s, i.mb))
            me["stash"][i.mb] = (me["w"], x)
            if me["last"]:
                losses[vw].append(float(me["math"].loss(me["w"], x, jnp.asarray(x_y[i.mb][1]))))
            else:
                me["out"] = me["math"].forward(me["w"], x)
        elif isinstance(i, SendAct):
            mail[("act", vw, i.peer, i.mb)] = jnp.asarray(np.asarray(me.pop("out")))
        elif isinstance(i, Bwd):
            w, x = me["stash"].pop(i.mb)
            if me["last"]:
                gw, gx = me["math"].loss_backward(w, x, jnp.asarray(x_y[i.mb][1]))
            else:
                gw, gx = me["math"].backward(w, x, mail.pop(("grad", vw, s, i.mb)))
            me["gw"][i.mb], me["gx"] = gw, gx
        elif isinstance(i, SendGrad):
            mail[("grad", vw, i.peer, i.mb)] = jnp.asarray(np.asarray(me.pop("gx")))
        elif isinstance(i, Apply):
            before = np.asarray(me["w"])
            after, me["opt"] = step(me["w"], me["gw"].pop(i.mb), me["opt"])
            wave = i.mb // NM
            zero = np.zeros_like(before)
            me["deltas"][wave] = me["deltas"].get(wave, zero) + (np.asarray(after) - before)
            me["w"] = after
        elif isinstance(i, Push):
            st = me["st"]
            delta = me["deltas"].get(i.wave, np.zeros(sum(flat.sizes[st.start:st.stop]), np.float32))
            pushed.setdefault(i.wave, {})[key] = {l: delta[slice(*layer_span(st, l))] for l in range(st.start, st.stop)}
            while len(pushed.get(len(history) - 1, {})) == len(stages):     # every stage pushed wave g: apply it
                c = len(history) - 1
                w_next = [v.copy() for v in history[-1]]
                for (pv, ps) in sorted(pushed[c]):
                    for l, dl in pushed[c][(pv, ps)].items():
                        w_next[l] = w_next[l] + dl
                history.append(w_next)
        elif isinstance(i, Pull):
            st = me["st"]
            g = recorded.get((vw, s, i.wave)) or {k: i.wave - d for k in range(len(p.ps_shards))}
            w = np.asarray(me["w"]).copy()
            for l in range(st.start, st.stop):
                a, b = layer_span(st, l)
                gk = g[owner[l]]
                merged = history[gk][l].copy()
                for c in sorted(me["deltas"]):
                    if c >= gk:
                        merged = merged + me["deltas"][c][a:b]
                w[a:b] = merged
            me["w"] = jnp.asarray(w)

    while any(me["pc"] < len(me["stream"]) for me in stages.values()):
        moved = False
        for key in sorted(stages):
            me = stages[key]
            while me["pc"] < len(me["stream"]) and ready(key, me["stream"][me["pc"]]):
                execute(key, me["stream"][me["pc"]])
                me["pc"] += 1
                moved = True
        if not moved:
            raise RuntimeError("reference: no stage can proceed (the record does not fit the schedule)")
    (out / f"reference_{d}.json").write_text(json.dumps({
        "losses": {str(v): ls for v, ls in losses.items()},
        "weights": {str(l): history[-1][l].tobytes().hex() for l in range(p.num_layers)},
        "torch": sys.modules.get("torch") is not None}))
    print("RESULT " + json.dumps({"mode": "reference", "d": d}), flush=True)


if __name__ == "__main__":
    mode, out, d = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    (run if mode == "run" else reference)(out, d)
