"""The extra outputs of the contract in plain torch (CONTRACT.md, "Extra outputs"): CrossEntropyOutput from
per-token statistics (the kernels' and the reference's), and the differentiable gradients of the lse (the z_loss
output) and of the entropy. contract.py re-exports every function here."""

import torch

from . import contract, token_inputs


def row_extras(z):
    """Per row of transformed logits z (..., V): (argmax, first index on ties, as int64; the mean of z under
    softmax(z), with -inf logits contributing 0). Plain torch, for the reference paths."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    mean_z = torch.where(p > 0, p * z, 0.0).sum(-1)
    return z.argmax(-1), mean_z


def extra_outputs(
    loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab, weight=None, entropy_grad=False
):
    """CrossEntropyOutput from the loss and per-token (lse, argmax, mean of z under softmax) of flat rows (N,),
    shaped like `labels`. z_loss is differentiable through lse (when lse requires grad); the entropy, lse - mean_z,
    through both with entropy_grad (mean_z then carries its true derivative: the caller's backward turns the pair
    of upstreams (a, b) into a + b on the lse and -b on the entropy, whose gradient is p (mz - z)), else detached. lse
    and accuracy carry no gradient. O(N) framework ops. weight: class weights (V,) or None: z_loss is then the loss's
    weighted term (w[y] z_loss lse^2, over the loss's weighted divisor); lse, accuracy and entropy ignore them."""
    ignore_index = options.ignore_index
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    shape = labels.shape
    lse = lse.view(shape)
    # A row holding +inf has no logsumexp (torch's gives +inf there, the kernels NaN): NaN in every output.
    lse = torch.where(lse.detach() == float("inf"), float("nan"), lse)
    bad_row = torch.isnan(lse.detach())
    live_lse = lse if entropy_grad else lse.detach()
    out = dict(loss=loss)
    divisor = contract.loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype)

    def reduced(values):
        return values if divisor is None else values.sum() / divisor

    if extras.z_loss:
        kept_lse = torch.where(ignored, 0.0, lse)  # ignored rows' lse is -inf: no inf * 0 in the gradient
        z_term = (options.z_loss * kept_lse * kept_lse) * torch.where(in_range | ignored, 1.0, float("nan")).to(
            lse.dtype
        )
        if weight is not None:
            z_term = z_term * contract.label_weights(labels, weight.to(z_term.dtype), vocab)
            z_divisor = contract.loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype, weight)
            out["z_loss"] = z_term if z_divisor is None else z_term.sum() / z_divisor
        else:
            out["z_loss"] = reduced(z_term)
    lse = lse.detach()
    if extras.lse:
        out["lse"] = torch.where(ignored, -float("inf"), lse)
    if extras.accuracy:
        hit = (argmax.view(shape) == labels).to(lse.dtype)
        hit = torch.where(in_range & ~bad_row, hit, float("nan"))
        hit = torch.where(ignored, 0.0, hit)
        if divisor is not None:
            hit = hit.sum() / (~ignored).sum().clamp_min(1).to(hit.dtype)
        out["accuracy"] = hit
    if extras.entropy:
        live_mean_z = mean_z if entropy_grad else mean_z.detach()
        entropy = torch.where(bad_row, float("nan"), live_lse - live_mean_z.view(shape))
        out["entropy"] = reduced(torch.where(ignored, 0.0, entropy))
    return contract.CrossEntropyOutput(**out)


def unshifted(output, kept, reduction):
    """A CrossEntropyOutput of shifted labels cut to the kept positions (shift=): per-token fields only."""
    if kept is None:
        return output
    fields = output._asdict()
    for name, value in fields.items():
        if value is not None and (name == "lse" or reduction == "none"):
            fields[name] = value[..., :kept]
    return contract.CrossEntropyOutput(**fields)


def reference_outputs(logits, labels, options, extras, reduction, n_items, loss, weight=None):
    """CrossEntropyOutput of the plain-torch path (the loss already computed by it)."""
    z = contract.transform(logits, options, labels)
    lse = torch.logsumexp(z, dim=-1)
    with torch.no_grad():
        argmax, mean_z = row_extras(z.detach())
    if extras.entropy:  # a differentiable entropy: mz with its gradient, NaN-free at -inf
        mean_z = softmax_mean(z)[1].squeeze(-1)
    return extra_outputs(
        loss, lse.reshape(-1), argmax.reshape(-1), mean_z.reshape(-1), labels, options, extras, reduction, n_items,
        logits.shape[-1], weight, extras.entropy,
    )  # fmt: skip


def lse_gradient(grad_lse, logits, labels, options):
    """d(sum_t grad_lse_t * lse_t) / d logits (..., V) in differentiable plain torch (float32; float64 for
    float64 logits): the z_loss output's gradient, as kernels.lse_backward computes it."""
    vocab = logits.shape[-1]
    options = options._replace(label_smoothing=0.0, z_loss=0.0)
    rows, flat = logits.reshape(-1, vocab), labels.reshape(-1)
    grad = contract.logits_gradient(
        grad_lse.reshape(-1), rows, flat, None, options, vocab_start=vocab, vocab_total=vocab
    )
    return grad.to(logits.dtype).reshape(logits.shape)


def softmax_mean(z):
    """(p = softmax(z), mz = sum_j p_j z_j per row, keepdim, and z with 0 where p_j = 0) in differentiable plain torch:
    -inf logits contribute 0 to mz and to its gradient (no 0 * inf, in the forward or the backward)."""
    p = torch.exp(z - torch.logsumexp(z, dim=-1, keepdim=True))
    z_kept = torch.where(p > 0, z, 0.0)
    return p, (p * z_kept).sum(-1, keepdim=True), z_kept


def entropy_gradient(grad_entropy, logits, labels, options, lse=None, mean_z=None):
    """d(sum_t grad_entropy_t * H_t) / d logits (..., V) in differentiable plain torch (float32; float64 for float64
    logits), H the entropy of softmax(z): dH/dz_j = p_j (mz - z_j), mz = sum_j p_j z_j, then dz/dx; 0 on ignored
    rows. What kernels.backward(grad_entropy=, mean_z=) adds. lse, mean_z: per row (N,), given for a slice of the
    vocabulary (vocab-parallel: the global ones); None: those of these logits."""
    shape, labels = logits.shape, labels.reshape(-1)
    logits = logits.reshape(-1, shape[-1])
    z = contract.transform(logits, options, labels)
    if lse is None:
        p, mean_z, z_kept = softmax_mean(z)
    else:
        p = torch.exp(z - lse.to(z.dtype).unsqueeze(-1))
        z_kept, mean_z = torch.where(p > 0, z, 0.0), mean_z.to(z.dtype).unsqueeze(-1)
    dz = p * (mean_z - z_kept) * grad_entropy.reshape(labels.shape).to(z.dtype).unsqueeze(-1)
    if options.logit_softcapping > 0.0:
        tanh_z = z / options.logit_softcapping
        dz = dz * (1.0 - tanh_z * tanh_z)
    if options.logit_scaling != 0.0:
        dz = dz * options.logit_scaling
    dz = torch.where((labels == options.ignore_index).unsqueeze(-1), 0.0, dz)
    return dz.to(logits.dtype).reshape(shape)


def weighted_output(result, labels, token_weights, reduction, n_items, ignore_index, weight=None):
    """The loss (or CrossEntropyOutput) of a call made with reduction="none", token-weighted and then reduced as
    `reduction` asks (CONTRACT.md, token_weights): loss and z_loss per token times w_t (ignored tokens 0), then
    divided like the loss (n_items, the kept count or the class weights' divisor; never the weights' sum); lse,
    accuracy and entropy unweighted, reduced as extra_outputs reduces them. O(N) framework ops."""
    output = result if isinstance(result, contract.CrossEntropyOutput) else contract.CrossEntropyOutput(result)
    fields = output._asdict()
    for name in ("loss", "z_loss"):
        if fields[name] is not None:
            fields[name] = token_inputs.apply_token_weights(fields[name], labels, token_weights, ignore_index)
    if reduction != "none":
        dtype = fields["loss"].dtype
        divisor = contract.loss_divisor(labels, reduction, n_items, ignore_index, dtype, weight)
        plain_divisor = contract.loss_divisor(labels, reduction, n_items, ignore_index, dtype)
        kept = (labels != ignore_index).sum().clamp_min(1).to(dtype)
        for name, by in (("loss", divisor), ("z_loss", divisor), ("accuracy", kept), ("entropy", plain_divisor)):
            if fields[name] is not None:
                fields[name] = fields[name].sum() / by
    if isinstance(result, contract.CrossEntropyOutput):
        return contract.CrossEntropyOutput(**fields)
    return fields["loss"]
