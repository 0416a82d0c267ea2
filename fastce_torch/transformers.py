"""Route Hugging Face transformers' causal-LM loss through fastce.

    import fastce_torch
    fastce_torch.patch_transformers()      # every *ForCausalLM model (and Trainer) now uses the fused loss
    ...
    fastce_torch.unpatch_transformers()    # the original transformers functions, exactly

Models do not import their loss: `PreTrainedModel.loss_function` looks `LOSS_MAPPING[model.loss_type]` up on each
call, so replacing the mapping's values is enough for models built before or after the patch. `transformers.trainer`
imports the name `ForCausalLMLoss` and compares `LOSS_MAPPING[...] is ForCausalLMLoss` to decide whether labels are
shifted (which changes how it counts `num_items_in_batch`), so that module-level name is replaced too, in every
loaded transformers module that holds it; modules imported after the patch pick up the replacement from loss_utils.

Differences from transformers' ForCausalLMLoss, on purpose:
- no `logits.float()`: the kernels read bf16/fp16 logits and compute in float32, so the float32 copy of the
  (tokens x vocab) logits, and its gradient, are never materialised. The loss is float32 as before.
- the gradient is written into the logits' buffer (inplace_backward=True, the default): after `loss.backward()`
  `outputs.logits` holds gradients, not logits. Pass `inplace_backward=False` if you read the logits after backward.
- a batch whose labels are all ignore_index gives loss 0 and zero gradients (fastce's "mean"), not NaN.

Coverage: the patch reaches every model whose forward calls `self.loss_function` with the causal-LM loss (Llama,
Mistral, Qwen, Gemma, Mixtral, ...: all that route through LOSS_MAPPING's ForCausalLM/ForConditionalGeneration
entries). The classes in COMPUTE_THEIR_OWN_LOSS build `torch.nn.CrossEntropyLoss()` inside their own forward instead
(their labels are already aligned, no shift), so they keep torch's loss. The only hook there would be the modeling
module's global `CrossEntropyLoss`, which the same modules' classification and seq2seq heads share; replacing it
would change losses nobody asked to patch, so they are listed instead (the test suite checks the list against the
installed transformers). Use `fastce_torch.CrossEntropyLoss` with their logits yourself to fuse them.

Softcapping (Gemma 2/3, `config.final_logit_softcapping`): those models apply `cap * tanh(logits / cap)` themselves
in `forward`, before calling the loss, and return the capped logits. The loss function receives neither the config
nor the raw logits, so it must not cap again: the patched loss always runs with logit_softcapping=0. Moving the cap
into the kernel would mean replacing each model's `forward` (and changing the logits it returns), which is not a
safe thing for a loss patch to do; call `fastce_torch.cross_entropy(raw_logits, labels, logit_softcapping=cap)`
from your own training step to fuse it.
"""

import inspect
import sys

import torch

from .cross_entropy import BACKENDS, cross_entropy

_LOSS_NAME = "ForCausalLMLoss"
# *ForCausalLM classes of transformers 5.x whose forward computes torch.nn.CrossEntropyLoss itself: not patched.
COMPUTE_THEIR_OWN_LOSS = (
    "BartForCausalLM",
    "BigBirdPegasusForCausalLM",
    "BlenderbotForCausalLM",
    "BlenderbotSmallForCausalLM",
    "ClvpForCausalLM",
    "CpmAntForCausalLM",
    "MBartForCausalLM",
    "MarianForCausalLM",
    "MusicgenForCausalLM",
    "MusicgenMelodyForCausalLM",
    "MvpForCausalLM",
    "PLBartForCausalLM",
    "PegasusForCausalLM",
    "TrOCRForCausalLM",
    "WhisperForCausalLM",
)
_NOT_OPTIONS = {"logits", "labels", "ignore_index", "reduction", "n_items", "logit_softcapping"}
_state = {"original": None, "options": {"backend": "auto", "inplace_backward": True}}


def fastce_for_causal_lm_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ForCausalLMLoss (same signature and semantics) computed by fastce, without upcasting."""
    if shift_labels is None:
        # Position t predicts token t + 1: append one ignored label and drop the first, as transformers does.
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    # reshape, not transformers' view: it is still a view wherever view works (the kernels take strided rows), and
    # it accepts logits that view refuses (transformers' .float() copy made those contiguous; we make no copy).
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    options = _state["options"]
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean", **options)
    if num_items_in_batch.dim() == 0 if torch.is_tensor(num_items_in_batch) else num_items_in_batch > 0:
        # A positive number or a 0-d tensor (int, or float after Trainer divides by the TP/CP size): the kernel
        # divides the sum by it in its own launch, with no extra ops per step.
        return cross_entropy(
            logits, shift_labels, ignore_index=ignore_index, reduction="sum", n_items=num_items_in_batch, **options
        )
    # A 1-element tensor (DataParallel), or a number <= 0: sum, then divide exactly as transformers'
    # fixed_cross_entropy does, so shape and value (inf/NaN for 0) stay transformers'.
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum", **options)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _modules_holding(function):
    """Loaded transformers modules whose global ForCausalLMLoss is `function` (read from the module's dict, never
    through getattr, so transformers' lazy modules are not made to import anything)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == "transformers" or name.startswith("transformers."):
            if getattr(module, "__dict__", {}).get(_LOSS_NAME) is function:
                found.append(module)
    return found


def patch_transformers(*, backend="auto", inplace_backward=True, **options):
    """Make transformers' causal-LM loss (every LOSS_MAPPING entry that is ForCausalLMLoss) use fastce.

    Models in COMPUTE_THEIR_OWN_LOSS (Bart, MBart, Marian, Pegasus, Whisper, ... *ForCausalLM) are not reached: they
    build torch's CrossEntropyLoss inside their forward (see the module docstring).

    Idempotent: calling it again only replaces the options. backend="auto" runs the kernels for CUDA logits and
    fastce's torch reference otherwise. Other keywords of fastce_torch.cross_entropy (z_loss,
    label_smoothing, logit_scaling, validate_labels) are passed on; those transformers decides (ignore_index,
    reduction, n_items) and logit_softcapping (the models cap their own logits, see above) are refused.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    refused = sorted(set(options) & _NOT_OPTIONS)
    if refused:
        raise TypeError(
            f"patch_transformers() does not take {refused}: ignore_index, the reduction and "
            "num_items_in_batch come from transformers' call, softcapping from the model"
        )
    unknown = sorted(set(options) - set(inspect.signature(cross_entropy).parameters))
    if unknown:
        raise TypeError(f"patch_transformers() got unexpected keywords {unknown}")
    from transformers.loss import loss_utils

    if _state["original"] is None:
        original = getattr(loss_utils, _LOSS_NAME)
        if original is fastce_for_causal_lm_loss:  # pragma: no cover - our state was lost (module reloaded)
            raise RuntimeError("transformers is patched by an earlier copy of fastce_torch.transformers")
        _state["original"] = original
    _state["options"] = {"backend": backend, "inplace_backward": bool(inplace_backward), **options}
    original = _state["original"]
    # Every alias (ForConditionalGeneration, CsmForConditionalGeneration, ...) that points at the same function.
    for key, function in list(loss_utils.LOSS_MAPPING.items()):
        if function is original:
            loss_utils.LOSS_MAPPING[key] = fastce_for_causal_lm_loss
    for module in _modules_holding(original):
        setattr(module, _LOSS_NAME, fastce_for_causal_lm_loss)


def unpatch_transformers():
    """Restore transformers' own ForCausalLMLoss everywhere the patch put fastce's (a no-op when not patched)."""
    original = _state["original"]
    if original is None:
        return
    from transformers.loss import loss_utils

    for key, function in list(loss_utils.LOSS_MAPPING.items()):
        if function is fastce_for_causal_lm_loss:
            loss_utils.LOSS_MAPPING[key] = original
    for module in _modules_holding(fastce_for_causal_lm_loss):
        setattr(module, _LOSS_NAME, original)
    _state["original"] = None
    _state["options"] = {"backend": "auto", "inplace_backward": True}


def is_patched():
    """True while patch_transformers() is in effect."""
    return _state["original"] is not None
