"""PNG of forward and forward+backward time vs V per implementation, memory floors drawn in (needs matplotlib)."""

from collections import Counter

from .report import floor_ms

FLOOR_STYLES = {1: ":", 2: "--", 3: "-."}


def sweep_rows(rows):
    """The rows of the vocabulary sweep: the (N, dtype) with the most distinct V values."""
    groups = Counter()
    for n, dtype in {(r["N"], r["dtype"]) for r in rows}:
        groups[(n, dtype)] = len({r["V"] for r in rows if (r["N"], r["dtype"]) == (n, dtype)})
    (n, dtype), _ = groups.most_common(1)[0]
    return n, dtype, [r for r in rows if r["N"] == n and r["dtype"] == dtype]


def write_plot(result, path) -> bool:
    """Returns False (and writes nothing) when matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not result["rows"]:
        return False
    n, dtype, rows = sweep_rows(result["rows"])
    bandwidth = result["copy_bandwidth_TBps"]
    vs = sorted({r["V"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title, floors in (
        (axes[0], "fwd_ms", "forward", (1,)),
        (axes[1], "fwdbwd_ms", "forward + backward", (2, 3)),
    ):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            points = sorted((r["V"], r[key]) for r in rows if r["impl"] == impl)
            ax.plot(*zip(*points), marker="o", label=impl, linewidth=2.5 if impl.startswith("fastce") else 1.2)
        for passes in floors if bandwidth else ():
            floor = [floor_ms({"N": n, "V": v, "dtype": dtype}, passes, bandwidth) for v in vs]
            ax.plot(vs, floor, color="black", linestyle=FLOOR_STYLES[passes], label=f"{passes}-pass memory floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(vs, [str(v) for v in vs])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        ax.set_xlabel("V (vocabulary)")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{title}, N={n} {dtype}")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{result['device']}, copy bandwidth {bandwidth:.2f} TB/s, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
