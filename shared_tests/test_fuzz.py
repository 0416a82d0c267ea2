"""Issue 7's fuzz: hypothesis draws shapes, options, dtypes and input pathologies, and each drawn case goes through
the same three-way comparison as the table (harness.run_case).

Repeatable and bounded for CI: derandomize=True (examples are a function of the test alone, the same on every
run), no example database, deadline=None (the interpreters are slow and the first call of a shape compiles),
FASTCE_FUZZ_EXAMPLES examples (default 60, about a minute on 2 CPU cores). Local fuzzing for longer:
FASTCE_FUZZ_EXAMPLES=500 FASTCE_FUZZ_RANDOM=1 python -m pytest shared_tests/test_fuzz.py
(FASTCE_FUZZ_RANDOM=1 draws new examples on every run; a failure prints the seed to reproduce it.)
"""

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import harness
from .harness import Case
from .reference import Options

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

EXAMPLES = int(os.environ.get("FASTCE_FUZZ_EXAMPLES", "60"))
RANDOM = os.environ.get("FASTCE_FUZZ_RANDOM", "") not in ("", "0")
MAX_TOKENS = 12

# Vocabularies: the edges (1, 2, odd), one tile +- 1 (4096), two tiles, and anything up to 3000.
VOCABS = st.one_of(st.sampled_from([1, 2, 3, 5, 127, 4095, 4097, 8193]), st.integers(1, 3000))


def _option(draw, strategy, off):
    return draw(st.one_of(st.just(off), strategy))


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = list(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    if math.prod(shape) > MAX_TOKENS:
        shape = [draw(st.integers(1, MAX_TOKENS))]
    if draw(st.sampled_from([False] * 7 + [True])):  # no tokens at all, now and then (hypothesis favours 0)
        shape[draw(st.integers(0, ndim - 1)) % len(shape)] = 0
    shape = tuple(shape)
    n = math.prod(shape)
    vocab = draw(VOCABS)
    opts = Options(
        ignore_index=draw(st.sampled_from([-100, -1, 0, vocab - 1])),
        logit_softcapping=_option(draw, st.floats(0.5, 50.0), 0.0),
        logit_scaling=_option(draw, st.floats(-3.0, 3.0).filter(lambda s: abs(s) > 1e-3), 0.0),
        # Nonzero options stay inside float32's normal range (|v| >= 1e-6 > 2**-126): both packages refuse
        # smaller nonzero values (test_shared_api.py's bad-argument cases).
        label_smoothing=_option(draw, st.one_of(st.floats(1e-6, 1.0), st.just(1.0)), 0.0),
        z_loss=_option(draw, st.floats(1e-6, 1e-2).flatmap(lambda v: st.sampled_from([v, -v])), 0.0),
    )
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    n_items = None
    if reduction != "none":
        n_items = draw(
            st.one_of(
                st.none(), st.integers(1, 50), st.floats(0.5, 50.0), st.tuples(st.just("tensor"), st.integers(1, 50))
            )
        )
    bad_values = [v for v in (-1, -7, vocab, vocab + 3, 2**31 - 1, -(2**31)) if v != opts.ignore_index]
    bad_labels = tuple(draw(st.lists(st.sampled_from(bad_values), max_size=2))) if n else ()
    row_pad = draw(st.sampled_from([0, 0, 1, 7]))
    return Case(
        name="fuzz",
        shape=shape,
        vocab=vocab,
        # float64 never reaches the kernels (the plain reference computes it; its own tests are in
        # test_shared_training.py), and only crosses into JAX with x64 on.
        dtype=draw(st.sampled_from([name for name in harness.TORCH_DTYPES if name != "float64"])),
        label_dtype=draw(st.sampled_from(["int64", "int32"])),
        reduction=reduction,
        n_items=n_items,
        opts=opts,
        ignore=draw(st.sampled_from(["none", "some", "some", "all", "class"])),
        bad_labels=bad_labels,
        neg_inf=draw(st.sampled_from(["", "", "tail", "scatter"])),
        nonfinite_rows=n >= 3 and not bad_labels and draw(st.booleans()),
        row_pad=row_pad,
        std=draw(st.floats(0.1, 8.0)),
        offset=draw(st.sampled_from([0.0, 0.0, 30.0, -50.0])),
        inplace=row_pad == 0 and draw(st.booleans()),
        jit=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_fuzz_against_reference(case, device):
    harness.run_case(case, device)
