"""One-off probes and device scripts behind bench/NOTES.md (tuning sweeps, host overhead, reduction cost, the
transformers training step, the H200 stage script): `python -m bench.tools.<name>`. Not part of `python -m bench`."""
