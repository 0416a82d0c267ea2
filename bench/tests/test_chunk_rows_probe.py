"""The chunk-rows probe's candidates (CPU): the package's own rule at each multiple, the package left as it was."""

from bench.linear_shapes import LinearShape
from bench.tools import chunk_rows_probe

linear_module = chunk_rows_probe.linear_module


def test_candidates_follow_the_package_rule_and_restore_it():
    before = linear_module.ROWS_MULTIPLE
    found = chunk_rows_probe.candidates(LinearShape(8192, 3584, 152064))
    assert linear_module.ROWS_MULTIPLE == before
    # 256 MiB of bf16 logits hold 882 rows of 152064: 11 chunks of 768 at 128, 10 of 832 at 64.
    assert found == {128: (768, 11), 64: (832, 10)}
    assert found[before] == (linear_module.rows_per_chunk(8192, 152064, 2), 11)


def test_a_shape_no_multiple_changes_is_timed_once():
    assert chunk_rows_probe.candidates(LinearShape(8192, 4096, 128256)) == {128: (1024, 8)}
