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

With `patch_transformers(fused_linear=True)` the main decoder families (FUSED_MODELS: Llama, Mistral, Mixtral,
Qwen2, Qwen3, Qwen3-MoE, Gemma 1/2/3, Phi-3) go further in training: when the model is in training mode and gets
labels, the loss comes from `fastce_torch.linear_cross_entropy(hidden_states, lm_head.weight, labels)` and the
(tokens x vocab) logits are never computed; the model then returns `logits=None` (as Liger-Kernel does), so code
that reads `outputs.logits` in training must not use this option. Gemma's final_logit_softcapping is fused into
the loss. In evaluation, or without labels, the model's own forward runs unchanged. How: the class's forward is
wrapped; the first fused call gives lm_head a dispatching `forward` (an instance attribute, removed again by
unpatch_transformers) that, while a fused call of its model is in progress, computes the loss from the hidden
states it receives and returns an empty (..., 0) stand-in for the logits, which the model's loss_function call
(this module's) recognises and answers with that loss; otherwise it is the head's own forward. lm_head is still
called through nn.Module.__call__, so its hooks run (FSDP and DeepSpeed gather the weight as usual). Everything
else the model does after its loss (Mixtral adding the router's auxiliary loss) happens as before. The same route
is traced by torch.compile (fullgraph, no logits-sized tensor in the graph). What the head computes (a PEFT LoRA
adapter on it, DeepSpeed ZeRO-3's partitioned weight, heads that cannot be fused) is integrations/heads.py's.

Softcapping (Gemma 2/3, `config.final_logit_softcapping`): without fused_linear, those models apply `cap *
tanh(logits / cap)` themselves in `forward`, before calling the loss, and return the capped logits. The loss
function receives neither the config nor the raw logits, so it must not cap again: the patched loss always runs with
logit_softcapping=0. Moving the cap into the kernel would mean replacing each model's `forward` (and changing the
logits it returns), which is not a safe thing for a loss patch to do; call `fastce_torch.cross_entropy(raw_logits,
labels, logit_softcapping=cap)` from your own training step to fuse it.
"""

import functools
import importlib
import inspect
import sys
import weakref

import torch

from ..core.options import BACKENDS
from ..losses.cross_entropy.api import cross_entropy
from ..losses.cross_entropy.linear_api import linear_cross_entropy
from .heads import head_terms

__all__ = [
    "COMPUTE_THEIR_OWN_LOSS",
    "FUSED_MODELS",
    "fastce_for_causal_lm_loss",
    "patch_transformers",
    "unpatch_transformers",
]

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
_state = {"original": None, "options": {"backend": "auto", "inplace_backward": True}, "forwards": {}}
# (module, class) of the *ForCausalLM models whose training forward fused_linear=True reroutes.
FUSED_MODELS = (
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("mixtral", "MixtralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ("gemma", "GemmaForCausalLM"),
    ("gemma2", "Gemma2ForCausalLM"),
    ("gemma3", "Gemma3ForCausalLM"),
    ("phi3", "Phi3ForCausalLM"),
)
# The fused calls in progress, innermost last (pushed by the wrapped forward, read by lm_head's dispatching forward
# and the loss function). A plain list: torch.compile cannot trace a ContextVar, and the unfused path never reads
# this (its logits are not empty).
_FUSED_CALLS = []
# The heads given a dispatching forward, for unpatch_transformers to take it back.
_DISPATCHING_HEADS = weakref.WeakSet()
# torch.compile before 2.13 traces an nn.Linear's call with the forward the module had when tracing began, so a
# forward given during the trace is not called (measured on torch 2.11; 2.13 and 2.14 call it): models made after
# the patch get it in __init__, others from their first eager call.
COMPILE_TRACES_OLD_FORWARD = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)


def _causal_lm_loss(compute, labels, num_items_in_batch, ignore_index, shift_labels):
    """transformers' ForCausalLMLoss around `compute(labels, shift, reduction, n_items)`: the label shift, and the
    reduction that num_items_in_batch asks for."""
    # Position t predicts token t + 1: transformers appends one ignored label and drops the first (a copy of the
    # labels); fastce's shift=1 is the same loss, on the unsliced logits (or hidden states).
    shift = 1 if shift_labels is None else 0
    labels = labels if shift_labels is None else shift_labels
    if num_items_in_batch is None:
        return compute(labels, shift, "mean", None)
    if num_items_in_batch.dim() == 0 if torch.is_tensor(num_items_in_batch) else num_items_in_batch > 0:
        # A positive number or a 0-d tensor (int, or float after Trainer divides by the TP/CP size): the kernel
        # divides the sum by it in its own launch, with no extra ops per step.
        return compute(labels, shift, "sum", num_items_in_batch)
    # A 1-element tensor (DataParallel), or a number <= 0: sum, then divide exactly as transformers'
    # fixed_cross_entropy does, so shape and value (inf/NaN for 0) stay transformers'.
    loss = compute(labels, shift, "sum", None)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fastce_for_causal_lm_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ForCausalLMLoss (same signature and semantics) computed by fastce, without upcasting."""
    if logits.shape[-1] == 0 and _FUSED_CALLS and _FUSED_CALLS[-1].loss is not None:
        # A fused call: lm_head computed this loss from the hidden states; adding the (empty) stand-in's sum changes
        # no bit and routes the gradient through lm_head's output (_FusedCall.lm_head_forward).
        return _FUSED_CALLS[-1].loss + logits.sum()
    options = _state["options"]

    def compute(labels, shift, reduction, n_items):
        # logits shaped (*labels, V) for the shift along the sequence; reshape, not transformers' view: it is still
        # a view wherever view works (the kernels take strided rows), and it accepts logits that view refuses
        # (transformers' .float() copy made those contiguous; we make no copy).
        return cross_entropy(
            logits.reshape(*labels.shape, vocab_size),
            labels.to(logits.device),
            shift=shift,
            ignore_index=ignore_index,
            reduction=reduction,
            n_items=n_items,
            **options,
        )

    return _causal_lm_loss(compute, labels, num_items_in_batch, ignore_index, shift_labels)


class _FusedCall:
    """One training forward of a fused model: its head, the labels and loss keywords, then the loss lm_head computed."""

    def __init__(self, model, labels, loss_kwargs):
        self.model, self.head, self.labels, self.loss_kwargs = model, model.lm_head, labels, loss_kwargs
        self.loss = None

    def lm_head_forward(self, hidden_states):
        # The head's output as one product (a LoRA adapter folded in, ZeRO-3's weight gathered: heads.py); under
        # autocast linear_cross_entropy runs the matmuls in the autocast dtype, as lm_head's F.linear would, and
        # accumulates a float32 weight's gradient in float32.
        hidden, weight, bias = head_terms(self.head, hidden_states)
        softcap = getattr(self.model.config, "final_logit_softcapping", None) or 0.0
        options = {k: v for k, v in _state["options"].items() if k != "inplace_backward"}
        kwargs = self.loss_kwargs
        ignore_index = kwargs.get("ignore_index", -100)

        def compute(labels, shift, reduction, n_items):
            return linear_cross_entropy(
                hidden.reshape(*labels.shape, hidden.shape[-1]),
                weight,
                labels.to(hidden.device),
                shift=shift,
                bias=bias,
                ignore_index=ignore_index,
                reduction=reduction,
                n_items=n_items,
                logit_softcapping=softcap,
                **options,
            )

        self.loss = _causal_lm_loss(
            compute, self.labels, kwargs.get("num_items_in_batch"), ignore_index, kwargs.get("shift_labels")
        )
        # Stands in for the logits: empty, so the model's own steps on them (softcapping) cost nothing, and the loss
        # function recognises it; made from the loss, so the loss the model returns (this plus the stand-in's empty
        # sum) reaches the model's output through lm_head's output. Module backward hooks on that output (ZeRO-3
        # gathering the head's weight again) so run before the loss's backward, and the ones on its input after.
        return self.loss.reshape((1,) * hidden_states.dim()).expand(*hidden_states.shape[:-1], 0)


def _dispatching_forward(head, *args, **kwargs):
    """lm_head's forward once a fused call has seen it: the fused loss while its model's fused call is in progress
    (once per call), the head's own forward otherwise (evaluation, generation, a PEFT wrapper calling it)."""
    call = _FUSED_CALLS[-1] if _FUSED_CALLS else None
    if call is not None and call.head is head and call.loss is None:
        return call.lm_head_forward(*args, **kwargs)
    return type(head).forward(head, *args, **kwargs)


def _has_dispatching_forward(head):
    return getattr(vars(head).get("forward"), "func", None) is _dispatching_forward


def _give_dispatching_forward(head):
    # Set once and kept (not swapped per call): torch.compile traces a plain read of it (and a partial, where it
    # cannot trace a bound method's creation), and the instance attribute leaves nn.Module.__call__ and the hooks as
    # they are.
    if not _has_dispatching_forward(head):
        head.forward = functools.partial(_dispatching_forward, head)
        _DISPATCHING_HEADS.add(head)


def _take_dispatching_forwards():
    for head in list(_DISPATCHING_HEADS):
        if _has_dispatching_forward(head):
            del head.forward
    _DISPATCHING_HEADS.clear()


def _fused_forward(original):
    signature = inspect.signature(original)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if not (self.training and labels is not None and _state["forwards"]):
            return original(self, *args, **kwargs)
        if COMPILE_TRACES_OLD_FORWARD and torch.compiler.is_compiling() and not _has_dispatching_forward(self.lm_head):
            raise RuntimeError(
                f"fused_linear under torch.compile on torch {torch.__version__}: lm_head is traced with the forward it "
                "had when compiling began, which is not fastce's yet; create the model after "
                "patch_transformers(fused_linear=True), or run one eager training forward (with labels) before "
                "compiling (torch >= 2.13 needs neither)"
            )
        _give_dispatching_forward(self.lm_head)
        call = _FusedCall(self, labels, dict(bound.arguments.get(var_keyword) or {}))
        _FUSED_CALLS.append(call)
        try:
            output = original(self, *args, **kwargs)
        finally:
            _FUSED_CALLS.pop()
        if call.loss is None:  # pragma: no cover - a forward that never called lm_head (a family changed upstream)
            raise RuntimeError(f"{type(self).__name__}.forward did not call lm_head: fused_linear cannot fuse it")
        if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...) -> (loss, ...), as to_tuple drops None
            return output[:1] + output[2:]
        return type(output)(**{key: value for key, value in output.items() if key != "logits"})

    forward.__fastce_original__ = original
    return forward


def _init_with_dispatching_head(original):
    """The model class's __init__, then lm_head given its dispatching forward (before any torch.compile trace)."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        head = getattr(self, "lm_head", None)
        if isinstance(head, torch.nn.Module):
            _give_dispatching_forward(head)

    return __init__


def fused_model_classes():
    for module_name, class_name in FUSED_MODELS:
        try:
            module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except ImportError:  # an older transformers without this family
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            yield cls


def _modules_holding(function):
    """Loaded transformers modules whose global ForCausalLMLoss is `function` (read from the module's dict, never
    through getattr, so transformers' lazy modules are not made to import anything)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == "transformers" or name.startswith("transformers."):
            if getattr(module, "__dict__", {}).get(_LOSS_NAME) is function:
                found.append(module)
    return found


def patch_transformers(*, backend="auto", inplace_backward=True, fused_linear=False, **options):
    """Make transformers' causal-LM loss (every LOSS_MAPPING entry that is ForCausalLMLoss) use fastce.

    Models in COMPUTE_THEIR_OWN_LOSS (Bart, MBart, Marian, Pegasus, Whisper, ... *ForCausalLM) are not reached: they
    build torch's CrossEntropyLoss inside their forward (see the module docstring).
    fused_linear=True: the FUSED_MODELS families compute their training loss with linear_cross_entropy from the
    hidden states, without logits, and return logits=None in training (see the module docstring).

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
    if fused_linear:
        for cls in fused_model_classes():
            if cls not in _state["forwards"]:
                _state["forwards"][cls] = (cls.forward, cls.__init__)
                cls.forward = _fused_forward(cls.forward)
                cls.__init__ = _init_with_dispatching_head(cls.__init__)
    else:
        _restore_forwards()


def _restore_forwards():
    _take_dispatching_forwards()
    for cls, (forward, init) in _state["forwards"].items():
        cls.forward = forward
        cls.__init__ = init
    _state["forwards"] = {}


def unpatch_transformers():
    """Restore transformers' own ForCausalLMLoss everywhere the patch put fastce's (a no-op when not patched)."""
    original = _state["original"]
    if original is None:
        return
    _restore_forwards()
    from transformers.loss import loss_utils

    for key, function in list(loss_utils.LOSS_MAPPING.items()):
        if function is fastce_for_causal_lm_loss:
            loss_utils.LOSS_MAPPING[key] = original
    for module in _modules_holding(fastce_for_causal_lm_loss):
        setattr(module, _LOSS_NAME, original)
    _state["original"] = None
    _state["options"] = {"backend": "auto", "inplace_backward": True}
