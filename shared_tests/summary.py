"""The largest torch-vs-jax differences seen in this session, per dtype, printed (and written to the JSON file named
by FASTCE_SHARED_SUMMARY) by shared_tests/conftest.py at the end of the session.

Per dtype: the number of torch-vs-jax comparisons, max |loss_torch - loss_jax| and max |grad_torch - grad_jax|
(absolute, over finite entries), the gradient difference in ulps of the dtype (over elements >= 1% of their row's
largest gradient), and how much of each tolerance was used at most (|diff| / bound; 1.0 = at the limit).
"""

RESULTS = {}


def record(dtype, device, stats):
    entry = RESULTS.setdefault(dtype, dict(device=device, cases=0))
    entry["cases"] += 1
    for key, value in stats.items():
        entry[key] = max(entry.get(key, 0.0), value)
