"""What a run reports besides its rows: progress lines on stderr (stdout keeps only the table) and failure
records (Unavailable: a package that is not installed, a note rather than a failure)."""

import sys
import time

_START = time.perf_counter()


def say(message: str) -> None:
    print(f"[bench {time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def error_text(exc: BaseException) -> str:
    """One line: the exception's type and first message line, then the first line of the error it was raised while
    handling (a failed capture's own error names no cause; the body's exception does)."""
    text = _first_line(exc)[:300]
    root, seen = exc, {id(exc)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__
        seen.add(id(root))
    if root is not exc:
        text += f" [first error: {_first_line(root)[:300]}]"
    return text


class Unavailable(ImportError):
    """The implementation's package is not installed: a note, not a failure."""


def optional(module, name, package):
    """module.name, or Unavailable when the package that holds it is not installed."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        raise Unavailable(f"{package} is not installed ({exc})") from exc


def load(name, loader, failures):
    """loader() or, where it raises (a missing or broken package must not stop the run), None and a failure noted."""
    try:
        return loader()
    except Exception as exc:  # noqa: BLE001
        failures.append(failure(name, None, "load", exc))
        say(f"{name}: skipped ({failures[-1]['error']})")
        return None


def note_failure(failures, what, impl, shape, stage, exc, /, **extra) -> None:
    """failure(...) and the extra fields appended to failures, and said as `what: FAILED why`. Positional-only: an
    extra field may be called shape (the linear rows record their LinearShape as text there)."""
    failures.append({**failure(impl, shape, stage, exc), **extra})
    say(f"{what}: FAILED {failures[-1]['error']}")


def measure_rows(what, loaders, measure, failures) -> list:
    """measure(impl, loaded) | {"impl": impl} for each impl whose loader loads; where measuring raises (an OOM, a
    keyword the installed fastce lacks: a result too), a failure record with `what` (the shape, as text) instead."""
    rows = []
    for impl, loader in loaders.items():
        try:
            if (loaded := load(impl, loader, failures)) is not None:
                rows.append(measure(impl, loaded) | {"impl": impl})
                say(f"{impl} {what}: {rows[-1]['fwdbwd_ms']:.2f} ms, loss {rows[-1]['loss']:.6f}")
        except Exception as exc:  # noqa: BLE001
            note_failure(failures, f"{impl} {what}", impl, None, "measure", exc, shape=what)
    return rows


def aligned(rows, rule=True) -> str:
    """Rows of cells as aligned text: the first column left-aligned, the others right-aligned; rule: a line of dashes
    under the first row (the headings)."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(rows) -> str:
    """Rows of cells as a markdown table, the first row its headings."""
    lines = ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines[:1] + ["|" + "---|" * len(rows[0])] + lines[1:])


def failure(impl, shape, stage, exc) -> dict:
    stage = "unavailable" if isinstance(exc, Unavailable) else stage
    record = {"impl": impl, "stage": stage, "error": error_text(exc)}
    if shape is not None:
        record.update(N=shape.N, V=shape.V, dtype=shape.dtype)
    return record
