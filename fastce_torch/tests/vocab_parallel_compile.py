"""vocab_parallel_check's torch.compile checks, one process per rank: compiling a loss with its graphs kept
(`compiled`) and checked (`check_graphs`: two O(N) all-reduces forward, no communication backward, no host
synchronisation), compiled-vs-eager tolerances, and the compile-only refusals and dynamic shapes."""

import torch
import torch.distributed as dist

import fastce_torch
from shared_tests import harness
from shared_tests.harness import Case


def compiled(fn, compile_backend):
    """torch.compile(fn, fullgraph=True): a graph break raises. With aot_eager the forward and backward graphs are
    kept (the returned dict) for check_graphs, partitioned as inductor partitions them (min-cut: aot_eager's
    default partitioner leaves the forward's statistics op in the backward as dead code)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = {"forward": [], "backward": []}
    if compile_backend == "aot_eager":

        def keep(kind):
            def compiler(gm, example_inputs):
                graphs[kind].append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        compile_backend = aot_autograd(
            fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=min_cut_rematerialization_partition
        )
    return torch.compile(fn, fullgraph=True, backend=compile_backend), graphs


def check_graphs(graphs, n_rows, backend, dtype):
    """The compiled forward communicates two all-reduces of O(N) floats (at most 3 N + 2: the row statistics and
    the width check), the backward nothing; no host synchronisation (no tensor read back as a number); with the
    kernels, the statistics op in the forward and the gradient op in the backward."""
    if not graphs["forward"]:
        return  # inductor: nothing recorded

    def calls(kind):
        return [node for gm in graphs[kind] for node in gm.graph.nodes if node.op == "call_function"]

    forward, backward_nodes = calls("forward"), calls("backward")
    collectives = [node for node in forward if str(node.target).startswith("_c10d_functional.all_reduce")]
    sizes = [node.args[0].meta["val"].numel() for node in collectives]
    assert len(collectives) == 2 and all(size <= 3 * n_rows + 2 for size in sizes), f"forward all-reduces {sizes}"
    communicating = {str(n.target) for n in backward_nodes if "c10d" in str(n.target)}
    assert not communicating, f"the backward communicates: {communicating}"
    synchronising = {str(n.target) for n in forward + backward_nodes if "_local_scalar_dense" in str(n.target)}
    assert not synchronising, f"a host synchronisation: {synchronising}"
    if backend == "kernel" and dtype != "float64":  # float64 is computed by the plain-torch formulas
        assert "fastce.vocab_parallel_statistics.default" in {str(n.target) for n in forward}, "no statistics op"
        assert "fastce.vocab_parallel_backward.default" in {str(n.target) for n in backward_nodes}, "no backward op"


def close_to_eager(value, eager, what):
    """Compiled vs eager: the same kernels and formulas, so equal up to the rounding of a reordered sum."""
    loose = value.dtype in (torch.bfloat16, torch.float16)
    tolerance = {} if loose else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, eager, equal_nan=True, **tolerance, msg=lambda m: f"{what} vs eager: {m}")


def run_compile_checks(device, widths, explicit, group, backend, compile_backend, opts):
    """Under torch.compile(fullgraph=True): unequal widths without vocab_start give NaN; vocab_start= (its layout
    check synchronises) is refused as a graph break naming it; a second backward through the compiled loss raises
    (torch.compile does not differentiate its backward again); dynamic=True serves three shapes from one graph."""
    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    case = Case("compile-errors", shape=(4,), vocab=sum(widths), opts=opts, seed=50)
    inputs = harness.make_inputs(case, device)
    local = inputs.logits[..., start : start + width].detach()
    if len(set(widths)) > 1:
        loss_of, _ = compiled(
            lambda x, y: fastce_torch.cross_entropy(x, y, process_group=group, backend=backend), compile_backend
        )
        loss = loss_of(local, inputs.labels)
        assert torch.isnan(loss), f"unequal widths without vocab_start must give NaN under compile, got {loss}"
    loss_of, _ = compiled(
        lambda x, y: fastce_torch.cross_entropy(x, y, process_group=group, vocab_start=start, backend=backend),
        compile_backend,
    )
    try:
        loss_of(local, inputs.labels)
    except torch._dynamo.exc.Unsupported as e:
        assert "disable" in str(e), e
    else:
        raise AssertionError("vocab_start= under torch.compile(fullgraph=True) did not raise")
    if not explicit:
        loss_of, _ = compiled(
            lambda x, y: fastce_torch.cross_entropy(x, y, process_group=group, backend=backend, **opts.as_kwargs()),
            compile_backend,
        )
        leaf = local.clone().requires_grad_()
        try:
            (grad,) = torch.autograd.grad(loss_of(leaf * 1.0, inputs.labels), leaf, create_graph=True)
            torch.autograd.grad(grad.sum(), leaf)
        except RuntimeError as e:
            # torch's own refusals: donated buffers (create_graph=True), "does not currently support double
            # backward", or, differentiating with respect to an input, that input "not used in the graph"; torch
            # 2.11: the compiled gradient "does not require grad".
            assert any(
                words in str(e)
                for words in ("double backward", "create_graph", "not have been used", "does not require grad")
            ), e
        else:
            raise AssertionError("a second backward through the compiled vocab-parallel loss did not raise")
        run_dynamic(device, width, group, backend, compile_backend, opts)


def run_dynamic(device, width, group, backend, compile_backend, opts):
    """torch.compile(dynamic=True, fullgraph=True): rows and the local width symbolic, one graph for every shape."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def loss_of(x, labels):
        return fastce_torch.cross_entropy(x, labels, reduction="sum", process_group=group, backend=backend,
                                          **opts.as_kwargs())  # fmt: skip

    torch._dynamo.reset()
    compiled_loss = torch.compile(loss_of, dynamic=True, fullgraph=True, backend=counting if compile_backend ==
                                  "aot_eager" else compile_backend)  # fmt: skip
    for rows, local_width in ((5, width), (7, width + 3), (3, width + 1)):
        case = Case("dynamic", shape=(rows,), vocab=local_width * world, opts=opts, reduction="sum", seed=rows)
        inputs = harness.make_inputs(case, device)
        results = []
        for fn in (loss_of, compiled_loss):
            leaf = inputs.logits[..., rank * local_width : (rank + 1) * local_width].detach().clone()
            leaf.requires_grad_()
            loss = fn(leaf * 1.0, inputs.labels)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        (want_loss, want_grad), (loss, grad) = results
        close_to_eager(loss, want_loss, f"dynamic {rows}x{local_width} loss")
        close_to_eager(grad, want_grad, f"dynamic {rows}x{local_width} grad")
    computing = [gm for gm in graphs if any(node.op == "call_function" for node in gm.graph.nodes)]
    assert compile_backend != "aot_eager" or len(computing) == 1, f"{len(computing)} graphs for dynamic shapes"
