"""torch.compile(fullgraph=True) over Linear -> fastce cross_entropy: no graph break, the custom ops are in the
compiled forward and backward graphs, and loss and gradients equal eager's (CPU: the kernels run in Triton's
interpreter inside the compiled graph; --gpu: CUDA)."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from fastce_torch import cross_entropy

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

VOCAB = 1000


class Head(torch.nn.Module):
    """An LM head and its loss: the logits are a non-leaf intermediate, the case the in-place backward is for."""

    def __init__(self, **options):
        super().__init__()
        self.proj = torch.nn.Linear(32, VOCAB)
        self.options = options

    def forward(self, hidden, labels, n_items=None):
        return cross_entropy(self.proj(hidden), labels, n_items=n_items, **self.options)


def inputs(device):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 8, 32, generator=generator)
    labels = torch.randint(0, VOCAB, (3, 8), generator=generator)
    labels[0, :4] = -100
    return hidden.to(device), labels.to(device)


def run(module, hidden, labels, **kwargs):
    module.zero_grad(set_to_none=True)
    hidden = hidden.clone().requires_grad_()
    loss = module(hidden, labels, **kwargs)
    loss.sum().backward()
    parameters = getattr(module, "_orig_mod", module).named_parameters()  # the compiled wrapper shares them
    return loss.detach(), hidden.grad, {name: p.grad for name, p in parameters}


def recording_backend():
    """aot_eager that keeps the forward and backward FX graphs it is given."""
    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs


def ops_in(graph_modules):
    return {str(node.target) for gm in graph_modules for node in gm.graph.nodes if node.op == "call_function"}


CASES = [
    dict(backend="kernel"),
    dict(backend="kernel", reduction="sum", logit_softcapping=30.0, label_smoothing=0.1, z_loss=1e-4),
    dict(backend="kernel", reduction="none"),
    dict(backend="kernel", inplace_backward=False),
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_fullgraph_compile_matches_eager(device, options):
    torch.manual_seed(0)
    module = Head(**options).to(device)
    hidden, labels = inputs(device)
    expected = run(module, hidden, labels)

    torch._dynamo.reset()
    backend, graphs = recording_backend()
    compiled = torch.compile(module, fullgraph=True, backend=backend)  # fullgraph: any graph break raises
    got = run(compiled, hidden, labels)

    assert "fastce.cross_entropy_forward.default" in ops_in(graphs["forward"])
    # Under compile the backward is the functional (out-of-place) op: the in-place one is for eager only.
    assert "fastce.cross_entropy_backward.default" in ops_in(graphs["backward"])
    for value, reference in zip(got[:2], expected[:2]):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_no_graph_break_with_tensor_n_items(device):
    """transformers passes num_items_in_batch as a 0-d tensor; explain() counts graph breaks directly."""
    module = Head(backend="kernel").to(device)
    hidden, labels = inputs(device)
    n_items = torch.tensor(17, device=device)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(module)(hidden, labels, n_items)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    expected = run(module, hidden, labels, n_items=n_items)
    torch._dynamo.reset()
    got = run(torch.compile(module, fullgraph=True, backend="aot_eager"), hidden, labels, n_items=n_items)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_matches_eager(device):
    """The default backend too (on the CPU inductor compiles the surrounding C++ once: ~25 s)."""
    torch.manual_seed(0)
    module = Head(backend="kernel").to(device)
    hidden, labels = inputs(device)
    expected = run(module, hidden, labels)
    torch._dynamo.reset()
    got = run(torch.compile(module, fullgraph=True), hidden, labels)
    for value, reference in zip(got[:2], expected[:2]):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)


def counting_backend():
    """aot_eager that counts the graphs dynamo hands it (one graph = no graph break)."""
    graphs = []

    def boxed(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

    return backend, graphs


class SlicedHead(torch.nn.Module):
    """The slice form of the shifted loss (README now shows shift=1): logits[:, :-1] against input_ids[:, 1:]
    (strided 3-D logits)."""

    def __init__(self, **options):
        super().__init__()
        self.proj = torch.nn.Linear(32, VOCAB)
        self.options = options

    def forward(self, hidden, input_ids, n_items=None):
        return cross_entropy(self.proj(hidden)[:, :-1], input_ids[:, 1:], n_items=n_items, **self.options)


DYNAMIC_CASES = [
    dict(backend="kernel"),
    dict(backend="kernel", reduction="sum", logit_softcapping=30.0, label_smoothing=0.1, z_loss=1e-4),
    dict(backend="kernel", reduction="none"),
]


@pytest.mark.parametrize("options", DYNAMIC_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_dynamic_shapes_fullgraph_one_graph(device, options):
    """dynamic=True with fullgraph=True: the argument checks trace (no math.isfinite on symbolic values), one
    graph serves batches of several shapes, and each matches eager."""
    torch.manual_seed(0)
    module = SlicedHead(**options).to(device)
    torch._dynamo.reset()
    backend, graphs = counting_backend()
    compiled = torch.compile(module, dynamic=True, fullgraph=True, backend=backend)
    for batch, seq in ((3, 8), (2, 11), (4, 5)):
        generator = torch.Generator().manual_seed(batch * seq)
        hidden = torch.randn(batch, seq, 32, generator=generator).to(device)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator).to(device)
        ids[0, :3] = -100
        n_items = torch.tensor(7, device=device) if options.get("reduction") == "sum" else None
        expected = run(module, hidden, ids, n_items=n_items)
        got = run(compiled, hidden, ids, n_items=n_items)
        for value, reference in zip(got[:2], expected[:2]):
            torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
        for name, grad in expected[2].items():
            torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # Dynamo may also hand over an empty graph (no calls): only graphs that compute count.
    computing = [gm for gm in graphs if any(node.op == "call_function" for node in gm.graph.nodes)]
    assert len(computing) == 1, f"{len(computing)} graphs: dynamo broke the graph or recompiled"
    torch._dynamo.reset()


def test_readme_example_has_no_graph_break(device):
    module = SlicedHead(backend="kernel").to(device)
    hidden, ids = inputs(device)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(module)(hidden, ids)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
