"""Memory floors, the results table, the JSON file and RESULTS.md (always generated from a JSON, never by hand)."""

import json
from pathlib import Path

from .shapes import DTYPE_BYTES

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
MiB = 1 << 20


def floor_ms(row, passes, bandwidth_TBps) -> float:
    """Time to move the logits' bytes `passes` times at the measured copy bandwidth.
    1 pass: read once (forward). 2 passes: read once, write the gradient once (a fused single-pass fwd+bwd).
    3 passes: read in forward, read and write in backward (a two-kernel fwd+bwd)."""
    nbytes = row["N"] * row["V"] * DTYPE_BYTES[row["dtype"]]
    return passes * nbytes / (bandwidth_TBps * 1e12) * 1e3


def add_ratios(row, bandwidth_TBps) -> dict:
    if bandwidth_TBps:
        row["fwd_over_1pass"] = row["fwd_ms"] / floor_ms(row, 1, bandwidth_TBps)
        row["fwdbwd_over_3pass"] = row["fwdbwd_ms"] / floor_ms(row, 3, bandwidth_TBps)
        row["fwdbwd_over_2pass"] = row["fwdbwd_ms"] / floor_ms(row, 2, bandwidth_TBps)
        if row.get("fwdbwd_leaf_ms") is not None:
            row["fwdbwd_leaf_over_3pass"] = row["fwdbwd_leaf_ms"] / floor_ms(row, 3, bandwidth_TBps)
        if row.get("fwdbwd_graph_ms") is not None:
            row["fwdbwd_graph_over_3pass"] = row["fwdbwd_graph_ms"] / floor_ms(row, 3, bandwidth_TBps)
        if row.get("fwdbwd_undonated_ms") is not None:
            row["fwdbwd_undonated_over_3pass"] = row["fwdbwd_undonated_ms"] / floor_ms(row, 3, bandwidth_TBps)
    return row


# (heading, row key of a time in ms or None, row key of its ratio to a floor or None). A cell reads "-" where the
# implementation's framework does not measure it and "n/a" where it was tried and could not be measured (the JSON
# and the lists under the table say why).
COLUMNS = (
    ("impl", None, None),
    ("N", None, None),
    ("V", None, None),
    ("dtype", None, None),
    ("fwd ms", "fwd_ms", None),
    ("fwd/1-pass floor", None, "fwd_over_1pass"),
    ("fwd+bwd ms (torch: non-leaf, JAX: donated)", "fwdbwd_ms", None),
    ("fwd+bwd/3-pass floor", None, "fwdbwd_over_3pass"),
    ("fwd+bwd/2-pass floor", None, "fwdbwd_over_2pass"),
    ("leaf .backward() ms", "fwdbwd_leaf_ms", None),
    ("leaf/3-pass floor", None, "fwdbwd_leaf_over_3pass"),
    ("CUDA graph fwd+bwd ms", "fwdbwd_graph_ms", None),
    ("graph/3-pass floor", None, "fwdbwd_graph_over_3pass"),
    ("JAX not donated ms", "fwdbwd_undonated_ms", None),
    ("not donated/3-pass floor", None, "fwdbwd_undonated_over_3pass"),
    ("peak extra MiB", None, None),
)
HEADINGS = tuple(heading for heading, _, _ in COLUMNS)


def table_cells(row) -> list:
    def ratio(key):
        return f"{row[key]:.2f}x" if key in row else "-"

    def ms(key):
        if key not in row:
            return "-"  # not measured for this implementation's framework
        return "n/a" if row[key] is None else f"{row[key]:.3f}"  # tried and failed: the JSON says why

    peak = f"{row['peak_extra_bytes'] / MiB:.1f}"
    if row.get("peak_extra_kind") == "xla_temp_size":
        peak = "temp " + peak
    fixed = {"impl": row["impl"], "N": str(row["N"]), "V": str(row["V"]), "dtype": row["dtype"], "peak extra MiB": peak}
    return [fixed[h] if h in fixed else ms(t) if t else ratio(r) for h, t, r in COLUMNS]


def text_table(rows) -> str:
    cells = [list(HEADINGS)] + [table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADINGS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(HEADINGS) + " |", "|" + "---|" * len(HEADINGS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def sort_rows(rows) -> list:
    """Group by shape (in the order first seen), implementations inside in their run order."""
    shape_order = {}
    for r in rows:
        shape_order.setdefault((r["N"], r["V"], r["dtype"]), len(shape_order))
    return sorted(rows, key=lambda r: shape_order[(r["N"], r["V"], r["dtype"])])


def write_json(result, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def default_json_path(date, device_slug) -> Path:
    return RESULTS_DIR / f"{date}-{device_slug}.json"


# "How it was measured", rendered into RESULTS.md under the table (prose: kept as markdown beside this module).
METHOD_MD = Path(__file__).resolve().parent / "METHOD.md"


def results_markdown(result, plot_name=None) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    parts = [
        "# fastce benchmark results",
        "",
        f"Generated by `python -m bench --results-md` from `{result.get('_source', '?')}`; do not edit by hand.",
        "",
        f"- date: {result['date']}",
        f"- device: {result['device']}",
        f"- commit: {result['commit']}",
        f"- versions: {versions}",
        f"- device-to-device copy bandwidth: {result['copy_bandwidth_TBps']:.2f} TB/s",
    ]
    for run in result.get("merged_from", []):
        parts.append(
            f"- merged from `{run['source']}` (commit {run['commit']}, {run['date']}, "
            f"copy bandwidth {run['copy_bandwidth_TBps']:.2f} TB/s)"
        )
    parts += ["", markdown_table(sort_rows(result["rows"])), ""]
    rows = result["rows"]
    sections = (  # (title, the rows or failures it lists, the key that says why)
        ("Not measured:", result.get("failures") or [], "error"),
        (
            "Not captured in a CUDA graph:",
            [r for r in rows if r.get("fwdbwd_graph_ms", 0) is None],
            "fwdbwd_graph_error",
        ),
        (
            "Leaf .backward() not measured:",
            [r for r in rows if r.get("fwdbwd_leaf_ms", 0) is None],
            "fwdbwd_leaf_error",
        ),
    )
    for title, entries, why in sections:
        if entries:
            parts += [title, ""]
            parts += [
                f"- {e['impl']} {e.get('N', '')}x{e.get('V', '')} {e.get('dtype', '')}: {e.get(why, '?')}"
                for e in entries
            ]
            parts += [""]
    if plot_name:
        parts += [f"![forward and forward+backward time vs V]({plot_name})", ""]
    parts += [METHOD_MD.read_text()]
    for linear_json in latest_linear_runs():
        parts += ["", linear_markdown(read_json(linear_json), _link(linear_json, RESULTS_MD.parent.parent))]
    # The bench tools' sections, each from the newest of its JSON files.
    for pattern, markdown in (
        ("*-overhead-*.json", host_time_markdown),
        ("*transformers-step*.json", transformers_step_markdown),
    ):
        found = sorted(RESULTS_DIR.glob(pattern))
        if found:
            parts += ["", markdown(read_json(found[-1]), _link(found[-1], RESULTS_MD.parent.parent))]
    return "\n".join(parts)


def latest_linear_runs(results_dir=RESULTS_DIR) -> list:
    """The fused linear table's JSON files (`run_h200.sh linear-a` / `linear-b`: the five shapes in two calls): for
    each of the two, every file of its newest date."""
    runs = {}
    for path in results_dir.glob("*-linear-[ab]-*.json"):
        stage = "a" if "-linear-a-" in path.name else "b"
        runs.setdefault(stage, []).append((read_json(path)["date"], path))
    latest = []
    for stage in sorted(runs):
        newest = max(date for date, _ in runs[stage])
        latest += sorted(path for date, path in runs[stage] if date == newest)
    return latest


def linear_markdown(result, source) -> str:
    """A `python -m bench --linear` JSON (forward+backward with the hidden and weight gradients) as a table."""
    from .linear import text_table

    heading = f"## Fused linear cross-entropy (from `{source}`)"
    about = (
        f"{result['device']}, commit {result['commit']}, {result['date']}, torch {result['torch']}; "
        "bench/NOTES.md explains where the fused rows lose to the unfused ones (the chunked cuBLAS products)."
    )
    return "\n".join([heading, "", about, "", text_table(result), ""])


# The overhead summary's figures in the host-time table's columns.
HOST_TIME_KEYS = (
    "total_us",
    "leaf_backward_us",
    "torch_cross_entropy_us",
    "do_nothing_function_us",
    "device_thread_hand_off_us",
    "floor_us",
)
HOST_TIME_PARTS = (
    ("autograd_function_us", "torch's autograd.Function with fastce's outputs and saved tensors, doing nothing"),
    ("launches_us", "the two compiled launchers' C calls"),
    ("allocations_us", "the forward's two allocations"),
    (
        "device_thread_excess_us",
        "what the engine's device thread costs this call beyond the bare hand-off (threads on minus off, less a "
        "do-nothing Function's)",
    ),
    ("fastce_python_us", "fastce's own Python (checks, layouts, launch keys, the Function's methods)"),
)


def host_time_markdown(run, source) -> str:
    """bench/tools/overhead.py's JSON: host time of one eager forward+backward and what it is made of, and the eager
    call against its kernels at the two host-bound shapes."""
    summary = run["summary"]

    def us(key):
        return "-" if summary.get(key) is None else f"{summary[key]:.1f}"

    lines = [
        f"## Host time of an eager call (from `{source}`)",
        "",
        f"{run['device']}, commit {run['commit']}, {run['date']}, torch {run['torch']}; "
        "`python -m bench.tools.overhead`, tiny inputs (64 x 1000 float32: the GPU idles, so wall time per call is "
        "host time), the fastest of "
        f"{run['repeat']} means over {run['calls']} calls, us per call.",
        "",
        "| cross_entropy forward+backward | leaf `.backward()` | F.cross_entropy | a do-nothing autograd.Function "
        "| of which the hand-off to the engine's device thread | floor of this design |",
        "|---|---|---|---|---|---|",
        "| " + " | ".join(map(us, HOST_TIME_KEYS)) + " |",
        "",
        "| part of the forward+backward | us |",
        "|---|---|",
        *(f"| {label} | {us(key)} |" for key, label in HOST_TIME_PARTS),
    ]
    if run.get("device_times"):
        lines += [
            "",
            "| N, V (bf16) | eager ms | the two kernels launched back to back | the two kernels from a CUDA graph |",
            "|---|---|---|---|",
            *(
                f"| {row['N']}, {row['V']} | {row['eager_ms']:.3f} | {row['kernels_ms']:.3f} | {row['graph_ms']:.3f} |"
                for row in run["device_times"]
            ),
        ]
    return "\n".join(lines) + "\n"


def transformers_step_markdown(step, source) -> str:
    """The training-step comparison written by bench/tools/transformers_step.py, as a table."""
    args, env = step["args"], step["environment"]
    lines = [
        f"## Training step with and without `patch_transformers()` (from `{source}`)",
        "",
        f"{env['device']}, commit {env['commit']}, transformers {env['transformers']}, torch {env['torch']}: "
        f"Llama, {args['layers']} layers, hidden {args['hidden']}, V={args['vocab']}, "
        f"{args['batch']}x{args['seq_len']} tokens, {args['precision']}, AdamW; median of {args['steps']} steps "
        f"after {args['warmup']} warm-up (CUDA events).",
        "",
        "| mode | median step ms | peak GiB | per-step working GiB | first-step loss |",
        "|---|---|---|---|---|",
    ]
    for mode, r in step["results"].items():
        lines.append(
            f"| {mode} | {r['median_ms']:.2f} | {r['peak_bytes'] / 2**30:.2f} | "
            f"{r['step_working_bytes'] / 2**30:.2f} | {r['losses'][0]:.5f} |"
        )
    return "\n".join(lines) + "\n"


def _link(path, start) -> str:
    """path relative to the folder `start` when inside it (links in RESULTS.md then work on GitHub)."""
    path = Path(path).resolve()
    return path.relative_to(start).as_posix() if path.is_relative_to(start) else str(path)


def write_results_md(json_path, plot_path=None) -> Path:
    result = read_json(json_path)
    result["_source"] = _link(json_path, RESULTS_MD.parent.parent)
    plot_name = _link(plot_path, RESULTS_MD.parent) if plot_path and Path(plot_path).exists() else None
    RESULTS_MD.write_text(results_markdown(result, plot_name))
    return RESULTS_MD
