"""What an LM head computes, as the one (hidden, weight, bias) triple that linear_cross_entropy takes, for the fused
route of patch_transformers(fused_linear=True): `hidden @ weight.T + bias` equals `lm_head(hidden)`.

- A plain head (any module whose forward is nn.Linear's: nn.Linear, its subclasses that keep that forward, FSDP2's
  wrapped class): its weight and bias as they are.
- A PEFT LoRA layer on the head: logits = h W^T + b + sum_a s_a drop_a(h) A_a^T B_a^T (+ s_a b_a with lora_bias),
  which is one product on concatenated operands: [h, s_1 drop_1(h) A_1^T, ...] @ [W, B_1, ...]^T. The adapter's
  own lora_A module and dropout run on the hidden states (so its dropout draws what PEFT's forward would draw, and
  ZeRO-3 gathers A in lora_A's forward as usual); autograd of the concatenation hands the gradients to A, B and W.
  The cost: a copy of the head's weight widened by the ranks, V x (H + sum r), for the step. Merged adapters (already
  in W) and disabled ones are PEFT's forward too. A PEFT `modules_to_save` copy of the head: the active copy.
- DeepSpeed ZeRO-3: outside their module's forward the parameters are empty partitions. The fused loss runs inside
  lm_head's forward, where ZeRO-3 has gathered the head's own parameters, and every other parameter it reads (a
  LoRA head's base weight and lora_B) is read as a module attribute there, which ZeRO-3 answers by gathering it and
  registering it as an external parameter of the head. The loss reaches the model's output through lm_head's output
  (transformers.py), so ZeRO-3's hooks on the head gather all of them again before the backward reaches the loss
  and release them after it, and each gradient accumulates into its full parameter, where ZeRO-3's hooks
  reduce-scatter it, as for any module. (A gather around the loss call alone, deepspeed.zero.GatheredParameters,
  is not enough: accumulating a trainable parameter's gradient needs the full parameter again in the backward.)
  Refused with an error: a parameter still partitioned when read (what torch.compile's trace would see), and a LoRA
  head marked a ZeRO-3 leaf module (ZeRO-3 reduces a leaf's gradients once the head's input gradient is ready,
  which comes before lora_B's through the concatenation).

Anything else on the head (other PEFT adapter types, LoRA variants such as DoRA, quantized bitsandbytes layers, a
module with its own forward) raises a TypeError naming it before any number is computed: computing from its
`.weight` would silently drop what its forward adds.
"""

import torch

__all__ = ["check_gathered", "head_terms", "is_zero3_parameter"]

_PEFT_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")
_PEFT_MODULES_TO_SAVE = ("peft.utils.other", "ModulesToSaveWrapper")


def _is_class(module, qualified):
    cls = type(module)
    return (cls.__module__, cls.__qualname__) == qualified


def _refuse(module, why):
    cls = type(module)
    raise TypeError(
        f"patch_transformers(fused_linear=True): lm_head is {cls.__module__}.{cls.__qualname__}, {why}; "
        "patch_transformers() without fused_linear computes the loss from the model's own logits"
    )


def _check_plain_linear(module, role="lm_head"):
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        _refuse(module, f"whose {role} forward is not nn.Linear's (a quantized or custom layer): its output is not "
                "hidden @ weight.T + bias, so the fused loss cannot be computed from its weight")  # fmt: skip


def is_zero3_parameter(tensor):
    """A parameter DeepSpeed ZeRO-3 partitions (it tags them with ds_id)."""
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


def _zero3_error(head, why):
    cls = type(head)
    return RuntimeError(
        f"patch_transformers(fused_linear=True) under DeepSpeed ZeRO-3: lm_head ({cls.__module__}.{cls.__qualname__}) "
        f"{why}; patch_transformers() without fused_linear computes the loss from the model's logits"
    )


def check_gathered(head, *tensors, lora=False):
    """ZeRO-3 parameters among `tensors` must be gathered now, and not a LoRA head's leaf-module parameters (see the
    module docstring): raises RuntimeError otherwise, before the loss reads them."""
    for tensor in tensors:
        if tensor is None or not is_zero3_parameter(tensor):
            continue
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if tensor.ds_status != ZeroParamStatus.AVAILABLE:
            raise _zero3_error(
                head, f"reads a {tuple(tensor.ds_shape)} parameter that ZeRO-3 has not gathered (under torch.compile "
                "its eager gathering does not run), so the loss would see an empty partition"
            )  # fmt: skip
        if lora and hasattr(tensor, "ds_z3_leaf_module"):
            raise _zero3_error(
                head, "is a LoRA layer marked a ZeRO-3 leaf module, whose gradients ZeRO-3 reduces before lora_B's "
                "arrives from the fused loss; unmark it (deepspeed.utils.set_z3_leaf_modules(model, "
                "[type(model.lm_head)], flag=False)): ZeRO-3 then gathers what the fused loss reads by itself"
            )  # fmt: skip


def _active_copy(head):
    """PEFT's modules_to_save wrapper: the copy its forward would call (the original when adapters are off)."""
    active = head.active_adapters
    if head.disable_adapters or not active or any(name not in head._adapters for name in active):
        return head.original_module
    return head.modules_to_save[active[0]]


def _lora_terms(layer, hidden):
    base = layer.base_layer
    _check_plain_linear(base, "base layer's")
    if layer.disable_adapters:
        if layer.merged:
            layer.unmerge()  # what PEFT's forward does with adapters disabled
        active = []
    else:
        active = [] if layer.merged else [name for name in layer.active_adapters if name in layer.lora_A.keys()]
    variants = [name for name in active if name in getattr(layer, "lora_variant", {})]
    if variants:
        _refuse(layer, f"with the LoRA variant {type(layer.lora_variant[variants[0]]).__name__} on adapter "
                f"{variants[0]!r} (DoRA, aLoRA, ...), which is not a plain low-rank product")  # fmt: skip
    weight, bias = base.weight, base.bias
    check_gathered(layer, weight, bias, lora=True)
    hiddens, weights, biases = [hidden], [weight], [] if bias is None else [bias]
    for name in active:
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        _check_plain_linear(lora_a, f"adapter {name!r} lora_A")
        _check_plain_linear(lora_b, f"adapter {name!r} lora_B")
        scale = layer.scaling[name]
        cast = getattr(layer, "_cast_input_dtype", None)  # PEFT's input cast (which its options can turn off)
        x = cast(hidden, lora_a.weight.dtype) if cast is not None else hidden.to(lora_a.weight.dtype)
        # Called as modules: the dropout draws PEFT's mask, and lora_A's hooks (ZeRO-3's gather) run.
        hiddens.append((lora_a(layer.lora_dropout[name](x)) * scale).to(hidden.dtype))
        b_weight, b_bias = lora_b.weight, lora_b.bias
        check_gathered(layer, b_weight, b_bias, lora=True)
        weights.append(b_weight.to(weight.dtype))
        if b_bias is not None:
            biases.append((b_bias * scale).to(weight.dtype))
    if len(hiddens) == 1:
        return hidden, weight, bias
    total_bias = None
    for term in biases:
        total_bias = term if total_bias is None else total_bias + term
    return torch.cat(hiddens, dim=-1), torch.cat(weights, dim=-1), total_bias


def head_terms(head, hidden):
    """(hidden, weight, bias) with hidden @ weight.T + bias = head(hidden), for linear_cross_entropy; raises
    TypeError for a head whose output is not that product (see the module docstring)."""
    if _is_class(head, _PEFT_MODULES_TO_SAVE):
        head = _active_copy(head)
    if _is_class(head, _PEFT_LORA_LINEAR):
        return _lora_terms(head, hidden)
    if type(head).__module__.startswith("peft."):
        _refuse(head, "a PEFT adapter type other than LoRA (only LoRA's low-rank product is fused)")
    _check_plain_linear(head)
    check_gathered(head, head.weight, head.bias)
    return hidden, head.weight, head.bias
