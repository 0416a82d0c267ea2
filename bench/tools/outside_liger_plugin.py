"""pytest plugin: fastce behind Liger-Kernel's cross-entropy entry points (`-p bench.tools.outside_liger_plugin`).

Replaces liger_kernel 0.8.5's cross-entropy entry points (Function.apply, the Loss module's forward, the fused linear
Function) by fastce adapters, so Liger's own tests check fastce; a keyword fastce cannot honour raises
NotImplementedError. With class weights, Liger's unweighted z-loss term comes from a second, unweighted fastce call.
"""

import torch

BACKEND = "auto"


def _check_labels(target, n_classes, ignore_index):
    kept = target.masked_select(target != ignore_index)
    if kept.numel() and (int(kept.max()) >= n_classes or int(kept.min()) < 0):
        raise AssertionError(f"Target {int(kept.max())} is out of bounds. Expected < {n_classes} and >= 0")


def _unsupported(name, value):
    raise NotImplementedError(f"fastce adapter: Liger's {name}={value!r} has no fastce counterpart")


def _common(ignore_index, reduction, label_smoothing, softcap, backend):
    """The keywords both adapters pass through (softcap None = off, fastce's 0)."""
    softcapping = float(softcap) if softcap is not None else 0.0
    return dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=float(label_smoothing),
                logit_softcapping=softcapping, backend=backend or BACKEND)  # fmt: skip


def _run(call, weight_kw, weight, lse_square_scale, return_z_loss, return_token_accuracy, options):
    """One or two fastce calls giving Liger's (loss, z_loss, token_accuracy): see the module docstring on z-loss."""
    asked = dict(return_z_loss=return_z_loss, return_accuracy=return_token_accuracy)
    if weight is None or not lse_square_scale:
        out = call(**options, **{weight_kw: weight}, z_loss=float(lse_square_scale), **asked)
        if return_z_loss or return_token_accuracy:
            return out.loss, out.z_loss, out.accuracy
        return out, None, None
    options = dict(options, inplace_backward=False) if "inplace_backward" in options else options
    weighted = call(**options, **{weight_kw: weight}, return_accuracy=return_token_accuracy)
    plain = call(**options, z_loss=float(lse_square_scale), return_z_loss=True)
    loss = (weighted.loss if return_token_accuracy else weighted) + plain.z_loss
    accuracy = weighted.accuracy if return_token_accuracy else None
    return loss, plain.z_loss if return_z_loss else None, accuracy


def cross_entropy_apply(
    _input,
    target,
    weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
    *,
    backend=None,
):
    """`LigerCrossEntropyFunction.apply`'s positional signature, computed by fastce_torch.cross_entropy."""
    import fastce_torch

    if return_predicted_tokens:
        _unsupported("return_predicted_tokens", return_predicted_tokens)
    _check_labels(target, _input.shape[-1], ignore_index)
    options = dict(logits=_input, labels=target, inplace_backward=True)
    options |= _common(ignore_index, reduction, label_smoothing, softcap, backend)
    asked = (lse_square_scale, return_z_loss, return_token_accuracy, options)
    loss, z_loss, accuracy = _run(fastce_torch.cross_entropy, "weight", weight, *asked)
    return _liger_tuple(loss, z_loss, accuracy, _input.dtype, _input.dtype)


def linear_cross_entropy_apply(
    _input,
    weight,
    target,
    bias=None,
    ce_weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    accum_dtype=None,
    use_token_scaling=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
    ce_impl=None,
    ce_mode=None,
    chunk_mem_const=None,
    *,
    backend=None,
):
    """`LigerFusedLinearCrossEntropyFunction.apply`'s positional signature, computed by linear_cross_entropy."""
    import fastce_torch

    if return_predicted_tokens:
        _unsupported("return_predicted_tokens", return_predicted_tokens)
    if use_token_scaling:
        _unsupported("use_token_scaling", use_token_scaling)
    if ce_impl is not None or ce_mode is not None:
        _unsupported("ce_impl/ce_mode", (ce_impl, ce_mode))
    if accum_dtype not in (None, torch.float32):
        _unsupported("accum_dtype", accum_dtype)
    _check_labels(target, weight.shape[0], ignore_index)
    options = dict(
        hidden=_input, weight=weight, labels=target, bias=bias, accumulate_in_float32=accum_dtype is not None
    )
    options |= _common(ignore_index, reduction, label_smoothing, softcap, backend)
    asked = (lse_square_scale, return_z_loss, return_token_accuracy, options)
    loss, z_loss, accuracy = _run(fastce_torch.linear_cross_entropy, "class_weight", ce_weight, *asked)
    return _liger_tuple(loss, z_loss, accuracy, loss.dtype, _input.dtype)


def _liger_tuple(loss, z_loss, accuracy, loss_dtype, z_loss_dtype):
    loss = loss.to(loss_dtype)
    z_loss = z_loss.to(z_loss_dtype) if z_loss is not None else None
    return loss, z_loss, accuracy, None


class _NoLigerKernel:
    """Stands for liger_cross_entropy_kernel: launching it fails, since fastce has no such kernel to test."""

    def __getitem__(self, grid):
        raise NotImplementedError("fastce adapter: this test launches Liger's own kernel; fastce does not replace it")

    def __call__(self, *args, **kwargs):
        self[None]


def _module_forward(self, _input, target):
    from liger_kernel.transformers.functional import CrossEntropyOutput

    names = ("weight", "ignore_index", "lse_square_scale", "label_smoothing", "reduction", "softcap", "return_z_loss",
             "return_token_accuracy", "return_predicted_tokens")  # fmt: skip
    loss, z_loss, accuracy, predicted = cross_entropy_apply(_input, target, *(getattr(self, n) for n in names))
    if not (self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)


def install():
    """Patch the installed liger_kernel in place (the classes themselves, so every importer sees fastce)."""
    import liger_kernel.ops.cross_entropy as ops_ce
    from liger_kernel.ops import LigerCrossEntropyFunction, LigerFusedLinearCrossEntropyFunction
    from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

    LigerCrossEntropyFunction.apply = staticmethod(cross_entropy_apply)
    LigerFusedLinearCrossEntropyFunction.apply = staticmethod(linear_cross_entropy_apply)
    LigerCrossEntropyLoss.forward = _module_forward
    ops_ce.liger_cross_entropy_kernel = _NoLigerKernel()


def pytest_configure(config):
    install()
