"""The float64 formula of fastce_jax's jsd / linear_jsd tests (test_jsd.py, test_linear_jsd.py; CONTRACT / issue 38),
written from the definitions, NumPy only: per-row loss and d loss / d student logits with the magnitudes their
float32 rounding scales with."""

import jax.numpy as jnp
import numpy as np

from shared_tests import tolerances

from .checks import as_float64


def host(array):
    """An array's values on the host in float64 (float64 arrays as they are)."""
    array = jnp.asarray(array)
    return np.asarray(array, np.float64) if array.dtype == jnp.float64 else as_float64(array)


class Expected:
    """Per-row loss and d loss_row / d student logits (float64), and the magnitudes their float32 rounding scales
    with (shared_tests/tolerances.py's model: |error| <= RTOL * scale + ulps + FLOOR)."""

    def __init__(self, student, teacher, labels, beta, temperature=1.0, student_softcapping=0.0,
                 teacher_softcapping=0.0, ignore_index=-100):  # fmt: skip
        xs = host(student)
        xt = host(teacher)[:, : xs.shape[1]]

        def u(x, cap):
            return (cap * np.tanh(x / cap) if cap else x) / temperature

        def log_softmax(v):
            m = np.max(v, axis=1, keepdims=True)
            lse = m + np.log(np.sum(np.exp(v - m), axis=1, keepdims=True))
            return v - lse, lse[:, 0]

        with np.errstate(all="ignore"):
            us, ut = u(xs, student_softcapping), u(xt, teacher_softcapping)
            (ls, lse_s), (lt, lse_t) = log_softmax(us), log_softmax(ut)
            ps, pt = np.exp(ls), np.exp(lt)
            if beta == 0.0:
                loss = kl = np.sum(np.where(pt == 0, 0.0, pt * (lt - ls)), axis=1)
                d_u = ps - pt
            elif beta == 1.0:
                loss = kl = np.sum(np.where(ps == 0, 0.0, ps * (ls - lt)), axis=1)
                d_u = np.where(ps == 0, 0.0, ps * (ls - lt - kl[:, None]))
            else:
                lm = np.logaddexp(np.log1p(-beta) + ls, np.log(beta) + lt)
                kl_t = np.sum(np.where(pt == 0, 0.0, pt * (lt - lm)), axis=1)
                kl = np.sum(np.where(ps == 0, 0.0, ps * (ls - lm)), axis=1)
                loss = beta * kl_t + (1 - beta) * kl
                d_u = (1 - beta) * np.where(ps == 0, 0.0, ps * (ls - lm - kl[:, None]))
            du_dx = np.full_like(xs, 1.0 / temperature)
            if student_softcapping:
                du_dx = du_dx * (1.0 - np.tanh(xs / student_softcapping) ** 2)
            magnitude = np.nan_to_num(np.abs(us) + np.abs(ut), posinf=0.0)
            stats = np.abs(lse_s) + np.abs(lse_t) + np.abs(kl)
            self.loss_scale = np.sum((ps + pt) * magnitude, axis=1) + stats
            self.grad_scale = du_dx * (ps + pt) * (1.0 + magnitude + stats[:, None])
        self.loss, self.grad = loss, d_u * du_dx
        self.counted = np.ones(len(loss), bool) if labels is None else np.asarray(labels) != ignore_index
        self.loss = np.where(self.counted, self.loss, 0.0)
        self.grad = np.where(self.counted[:, None], self.grad, 0.0)

    def weights(self, reduction, upstream=None):
        """d loss / d loss_row of the reduction (upstream for "none")."""
        if reduction == "none":
            return np.asarray(upstream, np.float64)
        if reduction == "sum":
            return np.ones(len(self.loss))
        return np.full(len(self.loss), 1.0 / max(self.counted.sum(), 1))

    def check_loss(self, loss, reduction="none", rtol=tolerances.RTOL):
        """The loss, per row ("none") or reduced, within rtol * its rounding scale."""
        bound = rtol * np.where(self.counted, self.loss_scale, 0.0) + tolerances.FLOOR
        expected = self.loss
        if reduction != "none":
            weights = self.weights(reduction)
            expected = np.sum(self.loss * weights)
            bound = np.sum(np.nan_to_num(bound) * weights) + rtol * np.sum(np.abs(self.loss * weights))
        tolerances.check(host(loss), expected, bound, "loss")

    def check_grad(self, grad, reduction="none", upstream=None, dtype=jnp.float32, rtol=tolerances.RTOL):
        """The student gradient of the reduced loss (of upstream . per-row losses for "none"), rounded to dtype."""
        weights = self.weights(reduction, upstream)[:, None]
        expected = self.grad * weights
        actual = host(grad)
        magnitude = np.maximum(np.abs(np.nan_to_num(actual)), np.abs(np.nan_to_num(expected)))
        bound = rtol * np.abs(weights) * np.nan_to_num(self.grad_scale) + tolerances.FLOOR
        bound = bound + tolerances.ULPS * tolerances.ulp(magnitude, dtype)
        tolerances.check(actual, expected, bound, "grad")

    def check(self, loss, grad, reduction="none", upstream=None, dtype=jnp.float32, rtol=tolerances.RTOL):
        self.check_loss(loss, reduction, rtol)
        self.check_grad(grad, reduction, upstream, dtype, rtol)
