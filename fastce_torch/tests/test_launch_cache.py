"""The launch cache (core/launch_cache.py's Launcher): a cached launch must start exactly the compiled variant
Triton's generic `kernel[grid](...)` would start for the same arguments, on the current stream, and every case it
cannot serve must take the generic path.

On the CPU (Triton's interpreter) the real kernels cannot be compiled, so the launchers are given a stand-in for
the JIT function that reproduces what Launcher relies on from Triton 3.6's JITFunction.run: the kernel's own
binder (Triton's specialisation of every argument, built for the CUDA backend), Triton's cache key
(compute_cache_key) and its per-device kernel cache of CompiledKernel objects. The launcher arguments are the ones
losses/cross_entropy/launch.py's forward / backward and linear/scale.py's scale_unless_one really build. With --gpu,
the real kernels run through both paths and must agree bitwise (test_cached_launches_match_generic_launches_bitwise).
"""

import os
import random
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel, make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

import fastce_torch
from fastce_torch.core import launch as core_launch
from fastce_torch.core import launch_cache as cache
from fastce_torch.core.options import Options
from fastce_torch.distributed import combine
from fastce_torch.distributed.combine import (
    vocab_parallel_loss_kernel,
    vocab_parallel_maxima_kernel,
    vocab_parallel_rescale_kernel,
)
from fastce_torch.linear import scale
from fastce_torch.linear.scale import scale_unless_one, scale_unless_one_kernel
from fastce_torch.losses.cross_entropy import launch
from fastce_torch.losses.cross_entropy.backward import backward_kernel
from fastce_torch.losses.cross_entropy.forward import forward_kernel

STREAM = 1234  # the stand-in current stream
# Nothing is launched in the stand-in tests, but the launchers take only CUDA tensors outside the interpreter.
STAND_IN_DEVICE = "cpu" if core_launch.INTERPRETED else "cuda"


class FakeSetting:
    def __init__(self, enabled=True):
        self.enabled = enabled


class FakeJIT:
    """A @triton.jit kernel as _Launcher sees it, launching nothing: kernel[grid](*args, **options) is
    JITFunction.run's lookup (binder, compute_cache_key, the device's kernel cache), 'compiling' a stand-in
    CompiledKernel for a new key; a CompiledKernel's launcher records its call."""

    def __init__(self, jit_function):
        jit = jit_function if isinstance(jit_function, JITFunction) else JITFunction(jit_function.fn)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(jit.signature, jit.params, backend)
        self.params = jit.params
        self.kernel_cache, self.kernel_key_cache = {}, {}
        self.device_caches = {0: (self.kernel_cache, self.kernel_key_cache, None, backend, self.binder)}
        self.debug, self.pre_run_hooks, self.used_global_vals = None, [], {}
        self.generic, self.direct = [], []
        self.returns_compiled = True

    def triton_key(self, args, options):
        options = dict(options, debug=self.debug or knobs.runtime.debug)
        options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        return compute_cache_key(self.kernel_key_cache, self.binder(*args, **options)[1], options)

    def __getitem__(self, grid):
        def run(*args, **options):
            key = self.triton_key(args, options)
            if key not in self.kernel_cache:
                compiled = CompiledKernel.__new__(CompiledKernel)
                compiled.function, compiled.packed_metadata = 1000 + len(self.kernel_cache), ("metadata", key)
                compiled._run = lambda *call: self.direct.append(call)
                self.kernel_cache[key] = compiled
            self.generic.append((grid, args, options))
            return self.kernel_cache[key] if self.returns_compiled else None

        return run


LAUNCHERS = {
    "forward_launcher": forward_kernel,
    "backward_launcher": backward_kernel,
    "scale_launcher": scale_unless_one_kernel,
    "maxima_launcher": vocab_parallel_maxima_kernel,
    "rescale_launcher": vocab_parallel_rescale_kernel,
    "vocab_parallel_loss_launcher": vocab_parallel_loss_kernel,
}
LAUNCHER_MODULES = {name: next(m for m in (launch, scale, combine) if hasattr(m, name)) for name in LAUNCHERS}


def fake_launchers(monkeypatch, setting=None):
    setting = FakeSetting() if setting is None else setting
    monkeypatch.setattr(core_launch, "launched", set())  # the capture guard's record: these variants never compiled
    fakes = {}
    for name, kernel in LAUNCHERS.items():
        fakes[name] = FakeJIT(kernel)
        launcher = cache.Launcher(fakes[name], setting, current_device=lambda: 0, current_stream=lambda d: STREAM)
        monkeypatch.setattr(LAUNCHER_MODULES[name], name, launcher)
    return fakes


def check_last_direct_call(fake, grid, options):
    """The direct call started Triton's own choice of compiled variant for its arguments, on the current stream,
    with no launch hooks, and passed every argument."""
    call = fake.direct[-1]
    assert call[:3] == grid and call[3] == STREAM and call[6:9] == (None, None, None)
    args = call[9:]
    expected = fake.kernel_cache[fake.triton_key(args, options)]
    assert (call[4], call[5]) == (expected.function, expected.packed_metadata)
    assert len(args) == len(fake.binder.__code__.co_varnames[: fake.binder.__code__.co_argcount])


def logits_of(n_rows, vocab, dtype=torch.float32, offset=0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(n_rows, vocab + offset, generator=generator).to(STAND_IN_DEVICE, dtype)
    return base[:, offset:]  # offset > 0: a view whose data pointer is not 16-byte aligned


def labels_of(n_rows, vocab, dtype=torch.int64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n_rows,), generator=generator).to(STAND_IN_DEVICE, dtype)


# Argument sets that Triton specialises differently: integers equal to 1 or not divisible by 16, the number of rows
# (the scratch pieces' alignment follows it), misaligned logits, dtypes, options, reductions, vocab-parallel starts.
FORWARD_CASES = [
    dict(n_rows=16, vocab=1000),
    dict(n_rows=17, vocab=1000),
    dict(n_rows=33, vocab=1000),
    dict(n_rows=1, vocab=1000),
    dict(n_rows=64, vocab=1),
    dict(n_rows=16, vocab=20000),
    dict(n_rows=16, vocab=1000, offset=1),
    dict(n_rows=16, vocab=1000, dtype=torch.bfloat16),
    dict(n_rows=16, vocab=1000, dtype=torch.float16, offset=3),
    dict(n_rows=16, vocab=1000, labels_dtype=torch.int32),
    dict(n_rows=16, vocab=1000, options=Options(ignore_index=1)),
    dict(n_rows=16, vocab=1000, options=Options(logit_softcapping=30.0, label_smoothing=0.1)),
    dict(n_rows=16, vocab=1000, options=Options(logit_scaling=0.5, z_loss=1e-4)),
    dict(n_rows=16, vocab=1000, reduction="none"),
    dict(n_rows=16, vocab=1000, reduction="sum", n_items=7.0),
    dict(n_rows=16, vocab=1000, reduction="mean", n_items="tensor"),
    dict(n_rows=16, vocab=1000, vocab_start=1, vocab_total=3000),
    dict(n_rows=16, vocab=1000, vocab_start=1000, vocab_total=3000),
]


FORWARD_OPTIONS = dict(num_warps=launch.FORWARD_WARPS, num_stages=launch.FORWARD_STAGES)


def run_forward(case, seed=0):
    n_rows, vocab = case["n_rows"], case["vocab"]
    logits = logits_of(n_rows, vocab, case.get("dtype", torch.float32), case.get("offset", 0), seed)
    labels = labels_of(n_rows, vocab, case.get("labels_dtype", torch.int64), seed + 1)
    n_items = case.get("n_items")
    if n_items == "tensor":
        n_items = torch.tensor(5, device=STAND_IN_DEVICE)
    options = case.get("options", Options())
    if "vocab_total" in case:
        return launch.forward(logits, labels, options, vocab_start=case["vocab_start"], vocab_total=case["vocab_total"])
    return launch.forward(logits, labels, options, case.get("reduction", "mean"), n_items)


def test_cached_forward_launches_are_tritons_own_choice(monkeypatch):
    fakes = fake_launchers(monkeypatch)
    fake = fakes["forward_launcher"]
    launcher = launch.forward_launcher
    options = FORWARD_OPTIONS
    for case in FORWARD_CASES:
        generic, direct = len(fake.generic), len(fake.direct)
        run_forward(case, seed=0)
        if len(fake.direct) > direct:  # served by the cache: must be what Triton would have launched
            check_last_direct_call(fake, tuple(fake.direct[-1][:3]), options)
        else:
            assert len(fake.generic) == generic + 1
        # The same case again (fresh tensors, same shapes): always the cache now.
        generic, direct = len(fake.generic), len(fake.direct)
        run_forward(case, seed=5)
        assert (len(fake.generic), len(fake.direct)) == (generic, direct + 1), case
        check_last_direct_call(fake, tuple(fake.direct[-1][:3]), options)
    # Every case here is its own variant except those that share Triton's specialisation: at least a dozen.
    assert len(fake.kernel_cache) >= 12
    assert len(fake.generic) == len(fake.kernel_cache)  # no known variant took the generic path
    assert launcher.hits == len(fake.direct) and launcher.failure is None


def test_integer_one_and_divisibility_get_their_own_variants(monkeypatch):
    fake = fake_launchers(monkeypatch)["forward_launcher"]
    run_forward(dict(n_rows=32, vocab=1000))
    run_forward(dict(n_rows=32, vocab=1000))
    assert (len(fake.generic), len(fake.direct)) == (1, 1)
    # An integer equal to 1, one not divisible by 16, misaligned logits: each a variant of its own.
    for variants, case in enumerate(
        (dict(n_rows=1, vocab=1000), dict(n_rows=31, vocab=1000), dict(n_rows=32, vocab=1000, offset=2)), start=2
    ):
        run_forward(case)
        assert len(fake.generic) == len(fake.kernel_cache) == variants, case
    for n_rows in (48, 64, 47, 2, 3):  # whatever Triton makes of these: only new variants take the generic path
        run_forward(dict(n_rows=n_rows, vocab=1000))
        if fake.direct:
            check_last_direct_call(fake, tuple(fake.direct[-1][:3]), FORWARD_OPTIONS)
    assert len(fake.generic) == len(fake.kernel_cache)


@pytest.mark.parametrize("grad_shape", ["scalar", "per_token", "strided"])
@pytest.mark.parametrize("with_denominator", [True, False])
def test_cached_backward_launches_are_tritons_own_choice(monkeypatch, grad_shape, with_denominator):
    fake = fake_launchers(monkeypatch)["backward_launcher"]
    options = dict(num_warps=launch.BACKWARD_WARPS)
    for n_rows, vocab, offset in ((16, 1000, 0), (17, 3000, 0), (16, 1000, 1), (1, 1000, 0)):
        for seed in (0, 1):
            logits = logits_of(n_rows, vocab, torch.bfloat16, offset, seed)
            labels = labels_of(n_rows, vocab)
            lse = torch.randn(n_rows, device=STAND_IN_DEVICE)
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=STAND_IN_DEVICE)
            ones = torch.ones(2 * n_rows, device=STAND_IN_DEVICE)
            grad_loss = {
                "scalar": ones[0],
                "per_token": ones[:n_rows],
                "strided": ones[::2],
            }
            denominator = ones[:1] if with_denominator else None
            direct = len(fake.direct)
            launch.backward(grad_loss[grad_shape], logits, labels, lse, grad, Options(), denominator)
            if seed:
                assert len(fake.direct) == direct + 1
            if len(fake.direct) > direct:
                check_last_direct_call(fake, tuple(fake.direct[-1][:3]), options)


def test_cached_scale_launches_are_tritons_own_choice(monkeypatch):
    fake = fake_launchers(monkeypatch)["scale_launcher"]
    for numel in (16, 17, 1, 16, 17, 1, 8192):
        scale_unless_one(torch.randn(numel, device=STAND_IN_DEVICE), torch.ones((), device=STAND_IN_DEVICE))
        if fake.direct:
            check_last_direct_call(fake, tuple(fake.direct[-1][:3]), {})
    assert len(fake.generic) == len(fake.kernel_cache) == 3  # 16 and 8192 share Triton's specialisation
    assert len(fake.direct) == 4


def test_hooks_setting_and_failures_take_the_generic_path(monkeypatch):
    setting = FakeSetting()
    fake = fake_launchers(monkeypatch, setting)["forward_launcher"]
    case = dict(n_rows=16, vocab=1000)
    run_forward(case)
    run_forward(case)
    assert (len(fake.generic), len(fake.direct)) == (1, 1)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)  # a profiler's launch hook: Triton must call it
    try:
        run_forward(case)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert (len(fake.generic), len(fake.direct)) == (2, 1)
    saved = knobs.runtime.launch_exit_hook
    knobs.runtime.launch_exit_hook = hook  # not a HookChain: counts as a hook
    try:
        run_forward(case)
    finally:
        knobs.runtime.launch_exit_hook = saved
    assert (len(fake.generic), len(fake.direct)) == (3, 1)
    run_forward(case)
    assert (len(fake.generic), len(fake.direct)) == (3, 2)

    setting.enabled = False
    run_forward(case)
    assert (len(fake.generic), len(fake.direct)) == (4, 2)
    setting.enabled = True

    fake.used_global_vals = {("SOME_GLOBAL", None): (1, {"SOME_GLOBAL": 2})}  # Triton raises on a changed global
    run_forward(case)
    assert (len(fake.generic), len(fake.direct)) == (5, 2)
    fake.used_global_vals = {}

    core_launch.forget_launches()
    assert not launch.forward_launcher.variants
    fake.returns_compiled = False  # a launch Triton skipped (jit_cache_hook): the cache gives up, the launch stays
    run_forward(case)
    assert launch.forward_launcher.failure is not None
    fake.returns_compiled = True
    run_forward(case)
    run_forward(case)
    assert (len(fake.generic), len(fake.direct)) == (8, 2)


def test_the_setting_is_read_once_from_the_environment():
    # Compiled mode (TRITON_INTERPRET=0) in a fresh process: the cache is on unless the variable says 0. Nothing
    # is launched, so no GPU is needed.
    code = (
        "from fastce_torch.core import launch, launch_cache as cache; "
        "print(launch.launch_cache_enabled(), cache.launch_cache_setting.refusal)"
    )
    # On a Triton other than the reproduced release the cache is refused at import, naming that release: Triton's
    # own launch path then serves every launch (test_other_triton_releases_take_tritons_own_launch_path).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    on = "True" if triton.__version__ == cache.LAUNCH_CACHE_TRITON else f"False {_other_release(triton.__version__)}"
    for value, expected in (("0", "False FASTCE_TORCH_LAUNCH_CACHE=0"), ("1", on)):
        env = {**os.environ, "TRITON_INTERPRET": "0", core_launch.LAUNCH_CACHE_VARIABLE: value, "PYTHONPATH": path}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == expected


def _other_release(version):
    return f"Triton {version}: the cached launch is written for Triton {cache.LAUNCH_CACHE_TRITON}"


def test_other_triton_releases_take_tritons_own_launch_path(monkeypatch):
    # The refusal as import computes it in compiled mode, for the installed Triton when it is not the reproduced
    # release (the release jobs of .ci/releases.sh), else for a stand-in version string. Launchers holding that
    # setting never record or replay a variant: every launch is Triton's own kernel[grid](...), with right results.
    version = triton.__version__ if triton.__version__ != cache.LAUNCH_CACHE_TRITON else "3.99.0"
    with monkeypatch.context() as compiled:
        compiled.setattr(cache.triton, "__version__", version)
        compiled.setattr(knobs.runtime, "interpret", False)
        compiled.delenv(core_launch.LAUNCH_CACHE_VARIABLE, raising=False)
        setting = cache.LaunchCacheSetting()
    assert not setting.enabled and setting.refusal == _other_release(version)
    for name, kernel in (("forward_launcher", forward_kernel), ("backward_launcher", backward_kernel)):
        monkeypatch.setattr(launch, name, cache.Launcher(kernel, setting))
    monkeypatch.setattr(core_launch, "launched", set())
    for _ in range(2):  # the second call is the one a cache would serve
        leaf = logits_of(12, 3000, seed=5).requires_grad_()
        labels = labels_of(12, 3000, seed=6)
        loss = fastce_torch.cross_entropy(leaf * 1.0, labels)
        (grad,) = torch.autograd.grad(loss, leaf)
        exact = leaf.detach().double().requires_grad_()
        want = torch.nn.functional.cross_entropy(exact, labels)
        (want_grad,) = torch.autograd.grad(want, exact)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-7)
    for launcher in (launch.forward_launcher, launch.backward_launcher):
        assert launcher.hits == 0 and launcher.variants == {} and launcher.failure is None


def test_the_interpreter_never_uses_the_cache():
    if not core_launch.INTERPRETED:
        pytest.skip("the CPU run (Triton's interpreter) only")
    assert not core_launch.launch_cache_enabled()
    with pytest.raises(RuntimeError, match="interpreter"):
        with core_launch.launch_cache(True):
            pass
    with core_launch.launch_cache(False):
        assert not core_launch.launch_cache_enabled()


# --- the launch key against Triton's binder, over random argument sets ---------------------------------------------

# Values at every edge of Triton's integer specialisation: 1, divisibility by 16, the int32 / int64 / uint64 ranges
# and beyond (where Triton raises).
EDGE_INTS = [0, 1, 2, -1, 15, 16, 17, 32, 48, -16, -17, 1000, 4096]
EDGE_INTS += [2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, -(2**31) - 16, 2**32, 2**32 + 1]
EDGE_INTS += [2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, -(2**63), -(2**63) - 1, -(2**63) - 16, 2**64 - 16]
EDGE_INTS += [2**64 - 1, 2**64, 2**70, -(2**70)]
KEY_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.int8]
KEY_DTYPES += [torch.uint8, torch.int16, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


class _Subclass(torch.Tensor):
    pass


def random_tensor(rng):
    dtype = rng.choice(KEY_DTYPES)
    base = torch.zeros(64, dtype=dtype)
    return base[rng.randrange(17) :]  # every alignment of the data pointer, whatever the element size


def random_int(rng):
    return rng.choice(EDGE_INTS) if rng.random() < 0.7 else rng.randrange(-(2**40), 2**40) * rng.choice((1, 16))


def random_like(value, rng, constexpr):
    """A random argument of the same kind as `value` (a tensor, int, bool, float), now and then another kind."""
    if rng.random() < 0.06:  # another type: each such set must take a layout of its own, or the binder
        return rng.choice([None, 1.5, 7, True, random_tensor(rng), torch.zeros(4).as_subclass(_Subclass)])
    if isinstance(value, torch.Tensor):
        return random_tensor(rng)
    if isinstance(value, bool):
        return rng.random() < 0.5
    if isinstance(value, int):
        return rng.choice([1, 2, 16, 64, 1024, 4096, 0]) if constexpr else random_int(rng)
    if isinstance(value, float):
        return rng.choice([0.0, -0.0, 1.0, 0.5, float("nan"), float("inf"), rng.uniform(-10, 10)])
    return value


def binder_outcome(binder, args):
    try:
        return binder(*args)[1]
    except (OverflowError, KeyError) as error:  # a value Triton refuses (int beyond uint64, unknown dtype)
        return type(error)


def layout_outcome(argument_layout, key):
    try:
        return argument_layout.specialization(key)
    except (OverflowError, KeyError) as error:
        return type(error)


def captured_arguments(monkeypatch):
    """Argument tuples launch.forward / backward / scale_unless_one really build, per launcher name."""
    fakes = fake_launchers(monkeypatch)
    for case in FORWARD_CASES:
        run_forward(case)
    for n_rows, vocab, offset in ((16, 1000, 0), (17, 3000, 1)):
        logits = logits_of(n_rows, vocab, torch.bfloat16, offset)
        ones = torch.ones(2 * n_rows, device=STAND_IN_DEVICE)
        lse = torch.randn(n_rows, device=STAND_IN_DEVICE)
        for grad_loss, denominator in ((ones[0], ones[:1]), (ones[::2], None)):
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=STAND_IN_DEVICE)
            launch.backward(grad_loss, logits, labels_of(n_rows, vocab), lse, grad, Options(), denominator)
    scale_unless_one(torch.randn(17, device=STAND_IN_DEVICE), torch.ones((), device=STAND_IN_DEVICE))
    for n_rows, check_widths, smoothing, reduction, n_items in (
        (16, True, 0.0, "none", None),
        (17, False, 0.1, "mean", None),
        (1, True, 0.0, "sum", 3.0),
        (33, True, 0.1, "mean", torch.tensor(5.0, device=STAND_IN_DEVICE)),
    ):
        options = Options(label_smoothing=smoothing)
        labels = labels_of(n_rows, 100)
        statistics = combine.vocab_parallel_statistics(logits_of(n_rows, 50), labels, options, 50, 100, check_widths)
        combine.vocab_parallel_rescale(statistics)
        combine.vocab_parallel_loss(statistics, labels, options, reduction, n_items, 100)
    return {name: [call[1] for call in fake.generic] for name, fake in fakes.items()}


def check_keys_against_binder(fake, launcher, argument_sets, rng):
    """For every argument set and random options: the launcher's key rebuilds the binder's specialisation (or both
    refuse the arguments), and within one layout of argument types equal keys <=> equal Triton keys."""
    by_key, by_triton = {}, {}
    fast = 0
    for args in argument_sets:
        options = (rng.choice((None, 1, 4, 8)), rng.choice((None, 1, 3)), rng.choice((False, True)), "")
        layout = launcher.layout(args)
        spec = binder_outcome(fake.binder, args)
        if layout[1] is None and isinstance(spec, type):
            continue  # keyed by the binder itself, which refuses these
        key = layout[0](args, *options)
        if layout[1] is not None:
            fast += 1
            assert layout_outcome(layout[1], key) == spec, (args, key)
        else:
            assert key[0] == tuple(spec)
        if isinstance(spec, type):
            continue  # Triton raises: never recorded, so never launched from the cache
        types = tuple(map(type, args))
        triton = (tuple(spec), options)
        assert by_key.setdefault((types, key), triton) == triton, args
        assert by_triton.setdefault((types, triton), key) == key, args
    return fast, len(by_key)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launch_keys_are_tritons_specialisation_over_random_arguments(monkeypatch, name):
    real = captured_arguments(monkeypatch)[name]
    fake = FakeJIT(LAUNCHERS[name])
    launcher = cache.Launcher(fake, FakeSetting(), current_device=lambda: 0, current_stream=lambda d: STREAM)
    constexpr = [param.is_constexpr for param in fake.params]
    rng = random.Random(f"keys {name}")
    sets = list(real)
    for _ in range(1500):
        template = rng.choice(real)
        # Most sets change a few arguments of a real one (nearby variants), some change every argument.
        share = 1.0 if rng.random() < 0.3 else 0.15
        sets.append(
            tuple(
                random_like(value, rng, is_constexpr) if rng.random() < share else value
                for value, is_constexpr in zip(template, constexpr)
            )
        )
    fast, distinct = check_keys_against_binder(fake, launcher, sets, rng)
    assert all(launcher.layout(args)[1] is not None for args in real)  # the real launches never need the binder
    assert fast > 1000 and distinct > 300, (fast, distinct)


def _toy_kernel(p, q, n, m, s, x, flag, nothing, annotated: tl.int32, K: tl.constexpr, L: tl.constexpr):
    pass


def test_launch_keys_follow_do_not_specialize_and_fall_back_where_unsure():
    """Flags Triton's binder honours (do_not_specialize, do_not_specialize_on_alignment), a const pointer, and the
    cases the key leaves to the binder: an annotated parameter, a tensor subclass, a constexpr neither int nor
    bool, a backend without Triton's native tensor specialisation."""
    jit = JITFunction(_toy_kernel, do_not_specialize=["n", "s"], do_not_specialize_on_alignment=["p", "m"])
    fake = FakeJIT(jit)
    launcher = cache.Launcher(fake, FakeSetting(), current_device=lambda: 0, current_stream=lambda d: STREAM)
    rng = random.Random("toy")
    sets = []
    for _ in range(3000):
        sets.append(
            (
                random_tensor(rng),
                random_tensor(rng),
                random_int(rng),
                random_int(rng),
                random_int(rng) if rng.random() < 0.9 else random_tensor(rng),
                rng.uniform(-1, 1),
                rng.random() < 0.5,
                None,
                random_int(rng),
                rng.choice([1, 16, 3, True, False]),
                rng.choice([0, 1, 2]),
            )
        )
    # The annotated parameter sends every set to the binder; the layout of the first eight parameters alone (no
    # annotation there) keys every set without it, and rebuilds the binder's specialisation of those eight.
    assert all(launcher.layout(args)[1] is None for args in sets[:50])
    check_keys_against_binder(fake, launcher, sets, rng)
    backend = fake.device_caches[0][3]
    assert cache.ArgumentLayout.build(fake.params[:8], tuple(map(type, sets[0][:8])), backend) is not None
    for args in sets:
        layout = cache.ArgumentLayout.build(fake.params[:8], tuple(map(type, args[:8])), backend)
        key = layout.key(args[:8], None, None, False, "")
        full = binder_outcome(fake.binder, args)
        if not isinstance(full, type):
            assert layout_outcome(layout, key) == full[:8], args
    subclass = (torch.zeros(4).as_subclass(_Subclass),) + sets[0][1:8]
    assert cache.ArgumentLayout.build(fake.params[:8], tuple(map(type, subclass)), backend) is None
    float_constexpr = tuple(map(type, sets[0][:9])) + (float, int)
    assert cache.ArgumentLayout.build(fake.params, float_constexpr, backend) is None

    class OtherBackend:
        supports_native_tensor_specialization = False

    assert cache.ArgumentLayout.build(fake.params[:8], tuple(map(type, sets[0][:8])), OtherBackend()) is None


def test_a_key_that_does_not_rebuild_tritons_specialisation_turns_the_cache_off(monkeypatch):
    fake = fake_launchers(monkeypatch)["forward_launcher"]
    monkeypatch.setattr(cache.ArgumentLayout, "specialization", lambda self, key: [("i32", "D")])
    case = dict(n_rows=16, vocab=1000)
    run_forward(case)
    assert "rebuild" in launch.forward_launcher.failure
    run_forward(case)
    assert (len(fake.generic), len(fake.direct)) == (2, 0)  # the generic path, every time


def test_argument_types_outside_the_layout_are_keyed_by_the_binder(monkeypatch):
    """A tensor subclass (here the logits): its launches go through the binder's key, still cached, still Triton's
    own choice of variant."""
    fake = fake_launchers(monkeypatch)["forward_launcher"]
    for seed in (0, 1):
        logits = logits_of(16, 1000, seed=seed).as_subclass(_Subclass)
        launch.forward(logits, labels_of(16, 1000), Options(), "mean")
    assert (len(fake.generic), len(fake.direct)) == (1, 1)
    check_last_direct_call(fake, tuple(fake.direct[-1][:3]), FORWARD_OPTIONS)
    (layout,) = launch.forward_launcher.variants[0].values()
    assert layout[1] is None
    run_forward(dict(n_rows=16, vocab=1000))  # plain tensors: a layout of their own, keyed without the binder
    run_forward(dict(n_rows=16, vocab=1000))
    assert [layout[1] is None for layout in launch.forward_launcher.variants[0].values()] == [True, False]
    assert len(fake.direct) == 2


def test_a_forked_child_forgets_the_variants(monkeypatch):
    fake_launchers(monkeypatch)
    run_forward(dict(n_rows=16, vocab=1000))
    assert launch.forward_launcher.variants
    core_launch.forget_variants_after_fork()  # what os.register_at_fork runs in the child
    assert not launch.forward_launcher.variants


class RunningJIT(FakeJIT):
    """FakeJIT whose generic launch and whose compiled variants' launchers both run the real (interpreted)
    kernel: the cached path's grid and arguments reach the kernel exactly as the generic path's."""

    def __init__(self, interpreted):
        super().__init__(interpreted)
        self.interpreted = interpreted

    def __getitem__(self, grid):
        record = super().__getitem__(grid)

        def run(*args, **options):
            compiled = record(*args, **options)
            self.interpreted[grid](*args, **options)

            def direct(grid_0, grid_1, grid_2, stream, function, metadata, *call):
                self.interpreted[(grid_0, grid_1, grid_2)](*call[3:], **options)

            compiled._run = direct
            return compiled

        return run


def test_cached_launches_match_generic_launches_bitwise_in_the_interpreter(monkeypatch):
    if not core_launch.INTERPRETED:
        pytest.skip("the CPU run (Triton's interpreter) only")
    setting = FakeSetting()
    for name, kernel in (
        ("forward_launcher", forward_kernel),
        ("backward_launcher", backward_kernel),
    ):
        launcher = cache.Launcher(RunningJIT(kernel), setting, current_device=lambda: 0, current_stream=lambda d: 0)
        monkeypatch.setattr(launch, name, launcher)
    monkeypatch.setattr(core_launch, "launched", set())
    for n_rows, vocab, options in ((16, 300, Options()), (5, 40000, Options(label_smoothing=0.1, z_loss=1e-4))):
        results = []
        for enabled in (False, True, True):  # generic; first cached call records; second one is cached
            setting.enabled = enabled
            logits = logits_of(n_rows, vocab, seed=3)
            labels = labels_of(n_rows, vocab, seed=4)
            loss, lse, denominator = launch.forward(logits, labels, options, "mean")
            grad = torch.empty_like(logits)
            launch.backward(torch.ones(()), logits, labels, lse, grad, options, denominator)
            results.append((loss, lse, grad))
        for got in results[1:]:
            for a, b in zip(got, results[0]):
                assert torch.equal(bits(a), bits(b))
    assert launch.forward_launcher.hits == 2 and launch.backward_launcher.hits == 2


# --- on the GPU: the real kernels, cached and generic, bitwise ---------------------------------------------------

GPU_CASES = [
    dict(shape=(16,), vocab=1000, dtype=torch.float32, reduction="mean", options={}),
    dict(shape=(17,), vocab=32000, dtype=torch.bfloat16, reduction="sum", options=dict(label_smoothing=0.1)),
    dict(shape=(1,), vocab=5000, dtype=torch.float16, reduction="none", options=dict(z_loss=1e-4)),
    dict(shape=(3, 11), vocab=20000, dtype=torch.bfloat16, reduction="mean", options=dict(logit_softcapping=30.0)),
    dict(shape=(64,), vocab=1, dtype=torch.float32, reduction="mean", options={}),
    dict(shape=(40,), vocab=70000, dtype=torch.bfloat16, reduction="mean", options=dict(logit_scaling=0.25)),
    dict(shape=(24,), vocab=1000, dtype=torch.float32, reduction="mean", options=dict(ignore_index=1)),
]


def bits(tensor):
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def _step(case, seed, device, strided):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    n_rows = 1
    for size in case["shape"]:
        n_rows *= size
    columns = case["vocab"] + (1 if strided else 0)
    base = torch.randn(*case["shape"], columns, generator=generator).to(device, case["dtype"])
    leaf = base.requires_grad_()
    logits = (leaf * 1.0)[..., 1:] if strided else leaf * 1.0  # intermediate: the gradient is written in place
    labels = torch.randint(0, case["vocab"], case["shape"], generator=generator).to(device)
    labels.view(-1)[::5] = case["options"].get("ignore_index", -100)
    loss = fastce_torch.cross_entropy(logits, labels, reduction=case["reduction"], **case["options"])
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), grad


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True])
def test_cached_launches_match_generic_launches_bitwise(device, strided):
    if not core_launch.launch_cache_enabled():
        pytest.skip(f"launch cache off in this process: {cache.launch_cache_setting.refusal}")
    for case in GPU_CASES:
        with core_launch.launch_cache(False):
            expected = [_step(case, seed, device, strided) for seed in (0, 1)]
        hits = launch.forward_launcher.hits, launch.backward_launcher.hits
        # Twice: the first call of a variant may take the generic path (and records it), the second is cached.
        got = [_step(case, seed, device, strided) for seed in (0, 1)]
        assert launch.forward_launcher.hits > hits[0] and launch.backward_launcher.hits > hits[1], case
        for (loss, grad), (loss_ref, grad_ref) in zip(got, expected):
            assert torch.equal(bits(loss), bits(loss_ref)), case
            assert torch.equal(bits(grad), bits(grad_ref)), case
    assert launch.forward_launcher.failure is None and launch.backward_launcher.failure is None


@pytest.mark.gpu
def test_cached_launches_are_captured_in_a_cuda_graph(device):
    """After the warm-up, the captured launches are cached ones, on the capture stream, and the replay gives the
    eager step's numbers bitwise."""
    if not core_launch.launch_cache_enabled():
        pytest.skip(f"launch cache off in this process: {cache.launch_cache_setting.refusal}")
    case = dict(shape=(48,), vocab=40000, dtype=torch.bfloat16, reduction="mean", options=dict(label_smoothing=0.1))
    generator = torch.Generator(device="cpu").manual_seed(3)
    static_leaf = torch.randn(48, 40000, generator=generator).to(device, torch.bfloat16).requires_grad_()
    static_labels = torch.randint(0, 40000, (48,), generator=generator).to(device)

    def step():
        loss = fastce_torch.cross_entropy(static_leaf * 1.0, static_labels, **case["options"])
        return loss, torch.autograd.grad(loss, static_leaf)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    hits = launch.forward_launcher.hits, launch.backward_launcher.hits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_grad = step()
    assert launch.forward_launcher.hits == hits[0] + 1 and launch.backward_launcher.hits == hits[1] + 1
    graph.replay()
    with core_launch.launch_cache(False):
        loss, grad = step()
    torch.cuda.synchronize()
    assert torch.equal(bits(static_loss), bits(loss)) and torch.equal(bits(static_grad), bits(grad))
