"""pytest plugin: fastce behind Liger-Kernel's loss entry points (`-p bench.tools.outside_liger_plugin`).

Points liger_kernel 0.8.5's entry points (the Functions' apply, the cross-entropy module's forward, and, where
fastce_torch has jsd, the JSD Functions) at fastce_torch.liger, where the argument mapping lives, so that Liger's
own tests check fastce through the drop-in users import. What the plugin adds is test harness only: Liger's
out-of-bounds-label AssertionError (fastce gives NaN without synchronising) and a stand-in for Liger's kernel,
which one test launches directly. A keyword fastce refuses raises NotImplementedError, named in the failure line.
"""

import inspect

BACKEND = "auto"


def _check_labels(target, n_classes, ignore_index):
    kept = target.masked_select(target != ignore_index)
    if kept.numel() and (int(kept.max()) >= n_classes or int(kept.min()) < 0):
        raise AssertionError(f"Target {int(kept.max())} is out of bounds. Expected < {n_classes} and >= 0")


def cross_entropy_apply(*args, backend=None, **kwargs):
    """`LigerCrossEntropyFunction.apply`: fastce_torch.liger's, after Liger's label check."""
    from fastce_torch import liger

    apply = liger.LigerCrossEntropyFunction.apply
    arguments = inspect.signature(apply).bind(*args, **kwargs)
    arguments.apply_defaults()
    given = arguments.arguments
    _check_labels(given["target"], given["_input"].shape[-1], given["ignore_index"])
    return apply(*args, **kwargs, backend=backend or BACKEND)


def linear_cross_entropy_apply(*args, backend=None, **kwargs):
    """`LigerFusedLinearCrossEntropyFunction.apply` (Liger checks no labels here)."""
    from fastce_torch import liger

    return liger.LigerFusedLinearCrossEntropyFunction.apply(*args, **kwargs, backend=backend or BACKEND)


class _NoLigerKernel:
    """Stands for liger_cross_entropy_kernel: launching it fails, since fastce has no such kernel to test."""

    def __getitem__(self, grid):
        raise NotImplementedError("fastce adapter: this test launches Liger's own kernel; fastce does not replace it")

    def __call__(self, *args, **kwargs):
        self[None]


def _module_forward(self, _input, target):
    """LigerCrossEntropyLoss.forward (0.8.5 goes through its backend dispatcher, not the Function), giving Liger's
    own CrossEntropyOutput record."""
    from liger_kernel.transformers.functional import CrossEntropyOutput

    names = ("weight", "ignore_index", "lse_square_scale", "label_smoothing", "reduction", "softcap", "return_z_loss",
             "return_token_accuracy", "return_predicted_tokens")  # fmt: skip
    loss, z_loss, accuracy, predicted = cross_entropy_apply(_input, target, *(getattr(self, n) for n in names))
    if not (self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)


def _with_backend(apply):
    return staticmethod(lambda *args, **kwargs: apply(*args, **kwargs, backend=BACKEND))


def install():
    """Patch the installed liger_kernel in place (the classes themselves, so every importer sees fastce)."""
    import liger_kernel.ops as ops
    import liger_kernel.ops.cross_entropy as ops_ce
    from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

    from fastce_torch import liger

    ops.LigerCrossEntropyFunction.apply = staticmethod(cross_entropy_apply)
    ops.LigerFusedLinearCrossEntropyFunction.apply = staticmethod(linear_cross_entropy_apply)
    LigerCrossEntropyLoss.forward = _module_forward
    ops_ce.liger_cross_entropy_kernel = _NoLigerKernel()
    if hasattr(liger, "LigerJSD"):  # fastce_torch with jsd / linear_jsd
        ops.LigerJSDFunction.apply = _with_backend(liger.LigerJSDFunction.apply)
        ops.LigerFusedLinearJSDFunction.apply = _with_backend(liger.LigerFusedLinearJSDFunction.apply)


def pytest_configure(config):
    install()
