"""The contract's non-numerical rules, checked on both packages with the same inputs (exchanged through DLPack):
bad arguments raise the same exception class naming the argument, validate_labels names the same first bad
position, and the reductions that both must read the same way."""

import numpy as np
import pytest
import torch

from . import exchange, reference, tolerances

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
fastce_jax = pytest.importorskip("fastce_jax")


def inputs(device, n=4, vocab=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((n, vocab), generator=gen).to(device)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[1] = -100
    return logits, labels.to(device)


def both(device, logits=None, labels=None, **kwargs):
    """Calls both packages; returns [(exception or None, result)] for torch and jax."""
    x, y = inputs(device)
    x = x if logits is None else logits
    y = y if labels is None else labels
    jax_kwargs = {
        k: (exchange.to_jax(v) if v.is_floating_point() else exchange.labels_to_jax(v))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in kwargs.items()
    }
    out = []
    for call, a, b, options in (
        (fastce_torch.cross_entropy, x, y, kwargs),
        (
            fastce_jax.cross_entropy,
            exchange.to_jax(x),
            exchange.labels_to_jax(y) if y.dtype in (torch.int32, torch.int64) else exchange.to_jax(y),
            jax_kwargs,
        ),
    ):
        try:
            out.append((None, call(a, b, **{"backend": "kernel", **options})))
        except Exception as error:  # noqa: BLE001 - the exception is the result under test
            out.append((error, None))
    return out


def bad(kwargs, error, name):
    key, value = next(iter(kwargs.items()))
    return pytest.param(kwargs, error, name, id=f"{key}={value!r}")


BAD_ARGUMENTS = [
    bad(dict(reduction="avg"), ValueError, "reduction"),
    bad(dict(backend="triton"), ValueError, "backend"),
    bad(dict(logit_softcapping=-1.0), ValueError, "logit_softcapping"),
    bad(dict(logit_softcapping=float("inf")), ValueError, "logit_softcapping"),
    bad(dict(logit_scaling=float("nan")), ValueError, "logit_scaling"),
    bad(dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    bad(dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    # below float32's normal range the kernels cannot represent the option (the interpreter would even go float64)
    bad(dict(label_smoothing=1e-40), ValueError, "label_smoothing"),
    bad(dict(logit_scaling=-1e-39), ValueError, "logit_scaling"),
    bad(dict(z_loss=float("inf")), ValueError, "z_loss"),
    bad(dict(n_items=0), ValueError, "n_items"),
    bad(dict(n_items=-2), ValueError, "n_items"),
    bad(dict(ignore_index=1.5), TypeError, "ignore_index"),
    bad(dict(ignore_index=True), TypeError, "ignore_index"),  # a bool is an int to Python: must be refused
    bad(dict(n_items=True), TypeError, "n_items"),
]


@pytest.mark.parametrize("kwargs,error,name", BAD_ARGUMENTS)
def test_bad_arguments_raise_the_same_error_in_both(kwargs, error, name, device):
    for package, (raised, _) in zip(("torch", "jax"), both(device, **kwargs)):
        assert isinstance(raised, error), f"{package}: {raised!r}"
        assert name in str(raised), f"{package}: {raised}"


@pytest.mark.parametrize("what", ["int logits", "float labels", "shape mismatch"])
def test_bad_inputs_raise_the_same_error_in_both(what, device):
    x, y = inputs(device)
    bad = {
        "int logits": dict(logits=x.to(torch.int32)),
        "float labels": dict(labels=y.to(torch.float32)),
        "shape mismatch": dict(labels=y[:3]),
    }[what]
    error = ValueError if what == "shape mismatch" else TypeError
    results = both(device, **bad)
    for package, (raised, _) in zip(("torch", "jax"), results):
        assert isinstance(raised, error), f"{package}: {raised!r}"
        assert ("logits" if what == "int logits" else "labels") in str(raised), f"{package}: {raised}"


def test_validate_labels_names_the_same_first_bad_position(device):
    x, _ = inputs(device, n=6, vocab=10)
    y = torch.tensor([[1, -100, 3], [4, 2000, -5]], device=device)  # first bad: [1, 1] (2000), then -5
    results = both(device, logits=x.reshape(2, 3, 10), labels=y, validate_labels=True)
    for package, (raised, _) in zip(("torch", "jax"), results):
        assert isinstance(raised, ValueError), f"{package}: {raised!r}"
        assert "labels[1, 1] = 2000" in str(raised), f"{package}: {raised}"


def test_validate_labels_accepts_ignore_index_and_the_range_edges(device):
    x, _ = inputs(device, n=4, vocab=10)
    y = torch.tensor([0, 9, -100, 5], device=device)
    (t_err, t_loss), (j_err, j_loss) = both(device, logits=x, labels=y, validate_labels=True)
    assert t_err is None and j_err is None
    ref = reference.expected(x.cpu().double().numpy(), y.cpu().numpy(), "mean")
    assert np.isfinite(ref.loss)
    for package, loss in (("torch", t_loss.item()), ("jax", float(j_loss))):
        tolerances.assert_loss(loss, ref, f"{package} loss")


@pytest.mark.parametrize("n_items", [4, ("tensor", 2.5)], ids=["int", "tensor"])
def test_n_items_overrides_the_sum_denominator_in_both(n_items, device):
    """Both packages: reduction="sum" with n_items is sum / n_items, like "mean" with n_items (the table and the
    fuzz check the values against the reference too)."""
    if isinstance(n_items, tuple):
        n_items = torch.tensor(n_items[1], device=device)
    (t_err, t_loss), (j_err, j_loss) = both(device, reduction="sum", n_items=n_items)
    assert t_err is j_err is None
    x, y = inputs(device)
    ref = reference.expected(x.cpu().double().numpy(), y.cpu().numpy(), "sum", n_items=n_items)
    plain = reference.expected(x.cpu().double().numpy(), y.cpu().numpy(), "sum")
    assert np.isclose(ref.loss * float(n_items), plain.loss)
    for package, loss in (("torch", t_loss.item()), ("jax", float(j_loss))):
        tolerances.assert_loss(loss, ref, f"{package} loss")


# Names only one framework has a use for: torch's nn.Module, the transformers patch and Unsloth's patch function.
TORCH_ONLY = {
    "CrossEntropyLoss",
    "patch_transformers",
    "unpatch_transformers",
    "fastce_for_causal_lm_loss",
    "patch_loss_functions",
}


def test_public_surface_is_the_same_in_both_packages():
    """Each package's __all__ names what users call; every name exists, and the two lists differ only by the
    torch-only integrations, so code moves between the frameworks by changing the import."""
    for package in (fastce_torch, fastce_jax):
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert not missing, f"{package.__name__}.__all__ names what it lacks: {missing}"
        assert not [name for name in package.__all__ if name.startswith("_")]
    assert set(fastce_torch.__all__) - TORCH_ONLY == set(fastce_jax.__all__)
    assert fastce_torch.DEFAULT_WORKSPACE_BYTES == fastce_jax.DEFAULT_WORKSPACE_BYTES
