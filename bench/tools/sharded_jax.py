"""fastce_jax vs XLA's own cross-entropy with sharded logits, on the GPUs of one host, in the same run.

    python -m bench.tools.sharded_jax --json bench/results/<date>-h200x2-sharded-jax.json
    python -m bench.tools.sharded_jax --smoke        # 2 CPU devices, tiny shapes, interpret mode: checks the code path

Per global shape (bf16) and sharding over a 1-D mesh ('d'), rows P('d', None) or vocabulary P(None, 'd'), each
implementation as jit(value_and_grad(loss), donate_argnums=0): fwdbwd_ms (host-timed, jax_measure.bench_ms),
temp_MiB (XLA's scratch per device), the compiled HLO's collectives (the largest against the local logits' size),
the gradient's sharding, and the local three-pass floor (1.5 x one elementwise pass over the sharded logits).
"""

import argparse
import math
import os
import re
import sys

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SHAPES = [(8192, 128256), (8192, 256000)]
SMOKE_SHAPES = [(16, 256)]


def collectives(hlo_text):
    """[{op, shape, elements}] of every collective in compiled HLO text (async pairs counted once, at -start)."""
    found = []
    pattern = re.compile(r"=\s*(\(?[^=]*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        dims = re.findall(r"\[([\d,]*)\]", m[1])
        elements = max((math.prod(int(n) for n in d.split(",") if n) for d in dims), default=1)
        found.append({"op": m[2], "shape": m[1].strip(), "elements": elements})
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="2 CPU devices, tiny shapes, interpret mode")
    parser.add_argument("--batch-ms", type=float, default=100.0, help="host-timing batch length")
    args = parser.parse_args(argv)

    from .. import jax_setup

    jax_setup.configure(interpret_only=args.smoke)
    if args.smoke:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import fastce_jax

    from .. import envinfo
    from ..jax_impls import xla_loss
    from ..jax_measure import bench_ms, peak_extra_bytes
    from ..report import write_json
    from ..shapes import IGNORE_INDEX

    devices = jax.devices()
    if len(devices) < 2:
        sys.exit(f"needs at least 2 devices, JAX sees {devices}")
    mesh = Mesh(np.array(devices), ("d",))
    layouts = {"rows": (P("d", None), P("d")), "vocab": (P(None, "d"), P())}

    def fastce(logits, labels):
        return fastce_jax.cross_entropy(logits, labels, backend="kernel")

    impls = {"fastce_jax": fastce, "xla": xla_loss()}
    rows = []
    for n, v in SMOKE_SHAPES if args.smoke else SHAPES:
        key_x, key_y = jax.random.split(jax.random.key(0))
        for layout, (x_spec, y_spec) in layouts.items():
            x_sharding, y_sharding = NamedSharding(mesh, x_spec), NamedSharding(mesh, y_spec)
            labels = jax.random.randint(key_y, (n,), 0, v, dtype=jnp.int32).at[::7].set(IGNORE_INDEX)
            labels = jax.device_put(labels, y_sharding)
            make_logits = jax.jit(lambda k, n=n, v=v: jax.random.normal(k, (n, v), jnp.bfloat16),
                                  out_shardings=x_sharding)  # fmt: skip
            copy = jax.jit(lambda a: a + jnp.bfloat16(1), in_shardings=x_sharding, out_shardings=x_sharding)
            x0 = make_logits(key_x)
            copy_ms = bench_ms(lambda x0=x0: copy(x0), args.batch_ms)
            del x0
            for name, loss_fn in impls.items():
                step_fn = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(x_sharding, y_sharding), donate_argnums=0)
                logits = make_logits(key_x)
                compiled = step_fn.lower(logits, labels).compile()
                found = collectives(compiled.as_text())
                temp = peak_extra_bytes(compiled)
                loss, grad = compiled(logits, labels)
                grad_spec = str(grad.sharding.spec)
                keeps = grad.sharding.is_equivalent_to(x_sharding, 2)
                state = {"x": grad if keeps else jax.device_put(grad, x_sharding)}
                del logits, grad

                def step(compiled=compiled, labels=labels, keeps=keeps, state=state):
                    _, g = compiled(state["x"], labels)
                    state["x"] = g if keeps else jax.device_put(g, x_sharding)
                    if args.smoke:
                        # XLA:CPU's fake devices share a small thread pool: programs with collectives queued
                        # back to back can starve each other's rendezvous.  GPUs queue them fine.
                        jax.block_until_ready(state["x"])
                    return state["x"]

                ms = bench_ms(step, args.batch_ms)
                local = n * v // len(devices)
                row = {"impl": name, "layout": layout, "logits_spec": str(x_spec), "N": n, "V": v}
                row["devices"] = len(devices)
                row |= {"fwdbwd_ms": ms, "temp_MiB": temp / 2**20, "local_logits_MiB": local * 2 / 2**20}
                row |= {"grad_spec": grad_spec, "grad_keeps_logits_sharding": bool(keeps), "collectives": found}
                row["largest_collective_elements"] = max((c["elements"] for c in found), default=0)
                row |= {"local_logits_elements": local, "copy_ms": copy_ms, "floor_3pass_ms": 1.5 * copy_ms}
                row["loss"] = float(loss)
                rows.append(row)
                del state
                print(f"N={n} V={v} {layout:5s} {name:10s} {ms:8.3f} ms  temp {row['temp_MiB']:8.1f} MiB  "
                      f"grad {grad_spec:16s} loss {row['loss']:.5f}  floor {row['floor_3pass_ms']:.3f} ms  "
                      f"{len(found)} collectives, largest {row['largest_collective_elements']} elements "
                      f"(local logits {local})", flush=True)  # fmt: skip
                for c in found:
                    print(f"      {c['op']:18s} {c['shape']}", flush=True)
    # fastce_jax vs XLA, same shape and layout.
    for r in rows:
        if r["impl"] == "fastce_jax":
            same = lambda o: (o["N"], o["V"], o["layout"]) == (r["N"], r["V"], r["layout"])
            x = next(o for o in rows if o["impl"] == "xla" and same(o))
            r["speedup_vs_xla"] = x["fwdbwd_ms"] / r["fwdbwd_ms"]
            print(f"N={r['N']} V={r['V']} {r['layout']:5s}: fastce_jax {r['speedup_vs_xla']:.2f}x XLA's speed")
    if args.json:
        env = envinfo.versions({"devices": [str(d.device_kind) for d in devices]})
        out = {"date": envinfo.today(), "commit": envinfo.git_commit(), "env": env, "smoke": args.smoke, "rows": rows}
        print(f"wrote {write_json(out, args.json)}")


if __name__ == "__main__":
    main()
