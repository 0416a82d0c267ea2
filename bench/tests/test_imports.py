"""bench's import graph (every import, at module level or inside a function, read from the source) has no cycle."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent


def module_name(path):
    parts = path.relative_to(BENCH.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    modules = {module_name(p): p for p in BENCH.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph):
    done, path = set(), []

    def visit(node):
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert {"bench.linear", "bench.jax_linear", "bench.runner", "bench.worker"} <= set(graph)
    assert "bench.linear_shapes" in graph["bench.jax_linear"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_bench_stays_within_its_line_budget():
    """Issue 35's budget: bench/'s Python outside bench/tests at most 4,000 lines, counted as `wc -l` counts."""
    files = [path for path in BENCH.rglob("*.py") if "tests" not in path.relative_to(BENCH).parts]
    lines = sum(path.read_text().count("\n") for path in files)
    assert lines <= 4000, f"bench/ has {lines} lines of Python outside bench/tests (budget: 4,000)"
