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
    # issue 37: the sampling temperature is a finite Python number > 0 (a bool is refused like ignore_index's)
    bad(dict(temperature=0.0), ValueError, "temperature"),
    bad(dict(temperature=-0.7), ValueError, "temperature"),
    bad(dict(temperature=float("nan")), ValueError, "temperature"),
    bad(dict(temperature=float("inf")), ValueError, "temperature"),
    bad(dict(temperature=True), TypeError, "temperature"),
]


@pytest.mark.parametrize("kwargs,error,name", BAD_ARGUMENTS)
def test_bad_arguments_raise_the_same_error_in_both(kwargs, error, name, device):
    for package, (raised, _) in zip(("torch", "jax"), both(device, **kwargs)):
        assert isinstance(raised, error), f"{package}: {raised!r}"
        assert name in str(raised), f"{package}: {raised}"


def has_keyword(name, function="cross_entropy"):
    import inspect

    return all(name in inspect.signature(getattr(m, function)).parameters for m in (fastce_torch, fastce_jax))


@pytest.mark.parametrize(
    "what,error",
    [("shape", ValueError), ("int dtype", TypeError), ("scalar", ValueError)],
)
def test_bad_token_weights_raise_the_same_error_in_both(what, error, device):
    if not has_keyword("token_weights"):
        pytest.skip("a package has no token_weights yet")
    x, y = inputs(device)
    weights = {
        "shape": torch.ones(y.shape[0] + 1, device=device),
        "int dtype": torch.ones(y.shape, dtype=torch.int32, device=device),
        "scalar": torch.ones((), device=device),
    }[what]
    for package, (raised, _) in zip(("torch", "jax"), both(device, token_weights=weights)):
        assert isinstance(raised, error), f"{package}: {raised!r}"
        assert "token_weights" in str(raised), f"{package}: {raised}"


@pytest.mark.parametrize("value", ["float16", "bfloat16", "float64", "bf16", 32, torch.float16])
def test_bad_logits_dtype_raises_in_both(value, device):
    """linear_cross_entropy and linear_log_probs accept logits_dtype None or float32 (the string or the framework's
    float32 dtype) only."""
    if not has_keyword("logits_dtype", "linear_cross_entropy"):
        pytest.skip("a package has no logits_dtype yet")
    import jax.numpy as jnp

    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(4, 8, generator=gen).to(device), torch.randn(10, 8, generator=gen).to(device)
    labels = torch.tensor([1, 2, -100, 9], device=device)
    jax_value = {torch.float16: jnp.float16}.get(value, value) if not isinstance(value, str) else value
    calls = [
        (lambda f: f(hidden, weight, labels, logits_dtype=value), fastce_torch),
        (
            lambda f: f(
                exchange.to_jax(hidden), exchange.to_jax(weight), exchange.labels_to_jax(labels), logits_dtype=jax_value
            ),
            fastce_jax,
        ),
    ]
    for call, module in calls:
        for function in ("linear_cross_entropy", "linear_log_probs"):
            if not callable(getattr(module, function, None)):
                continue
            with pytest.raises(ValueError, match="logits_dtype"):
                call(getattr(module, function))


@pytest.mark.parametrize("function", ["log_probs", "linear_log_probs"])
@pytest.mark.parametrize("temperature", [0.0, float("nan"), True])
def test_log_probs_refuse_a_bad_temperature_in_both(function, temperature, device):
    for module in (fastce_torch, fastce_jax):
        if not callable(getattr(module, function, None)):
            pytest.skip(f"{module.__name__} has no {function} yet")
    x, y = inputs(device)
    weight = torch.randn(x.shape[1], 8, device=device)  # (V, H): x @ weight is hidden (N, H)
    for module, convert, labels in (
        (fastce_torch, lambda t: t, lambda t: t),
        (fastce_jax, exchange.to_jax, exchange.labels_to_jax),
    ):
        args = (convert(x), labels(y)) if function == "log_probs" else (convert(x @ weight), convert(weight), labels(y))
        error = TypeError if temperature is True else ValueError
        with pytest.raises(error, match="temperature"):
            getattr(module, function)(*args, temperature=temperature)


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


# Names only one framework has a use for: torch's nn.Module, the transformers and TRL patches and Unsloth's patch
# function.
TORCH_ONLY = {
    "CrossEntropyLoss",
    "patch_transformers",
    "unpatch_transformers",
    "patch_trl",
    "unpatch_trl",
    "fastce_for_causal_lm_loss",
    "patch_loss_functions",
}


# Names only JAX has a use for: optax's integer-label loss (optax is a JAX library; torch users have
# F.cross_entropy, whose drop-in is fastce_torch.cross_entropy / CrossEntropyLoss).
JAX_ONLY = {"softmax_cross_entropy_with_integer_labels"}


def test_public_surface_is_the_same_in_both_packages():
    """Each package's __all__ names what users call; every name exists, and the two lists differ only by the
    framework-only integrations, so code moves between the frameworks by changing the import."""
    for package in (fastce_torch, fastce_jax):
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert not missing, f"{package.__name__}.__all__ names what it lacks: {missing}"
        assert not [name for name in package.__all__ if name.startswith("_")]
    assert set(fastce_torch.__all__) - TORCH_ONLY == set(fastce_jax.__all__) - JAX_ONLY
    assert not JAX_ONLY & set(fastce_torch.__all__) and JAX_ONLY <= set(fastce_jax.__all__)
    # issue 37's per-token RL functions and issue 38's distillation losses, in both (the same names and keywords)
    for name in ("LogProbOutput", "log_probs", "linear_log_probs", "jsd", "linear_jsd"):
        assert name in fastce_torch.__all__ and name in fastce_jax.__all__, name
    assert fastce_torch.LogProbOutput._fields == fastce_jax.LogProbOutput._fields == ("logprobs", "entropy")


@pytest.mark.parametrize(
    "function", ["cross_entropy", "linear_cross_entropy", "log_probs", "linear_log_probs", "jsd", "linear_jsd"]
)
def test_the_same_keywords_in_both_packages(function):
    """Code moves between the frameworks by changing the import: the same keywords with the same defaults, but
    torch's process_group / vocab_start (JAX shards through jit instead)."""
    import inspect

    if not (callable(getattr(fastce_torch, function, None)) and callable(getattr(fastce_jax, function, None))):
        pytest.skip(f"a package has no {function} yet")
    torch_only = {"process_group", "vocab_start", "inplace_backward"}

    def keywords(module):
        parameters = inspect.signature(getattr(module, function)).parameters.values()
        return {p.name: p.default for p in parameters if p.kind == p.KEYWORD_ONLY and p.name not in torch_only}

    assert keywords(fastce_torch) == keywords(fastce_jax)
    assert fastce_torch.DEFAULT_WORKSPACE_BYTES == fastce_jax.DEFAULT_WORKSPACE_BYTES
