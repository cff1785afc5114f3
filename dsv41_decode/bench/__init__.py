"""Benchmarks (GPU): timing under CUDA graphs, the measured bandwidth floor, results files and plots.

Every benchmark writes one JSON object per case to `<out>/<bench>-<gpu>.jsonl` (`out/` by default,
ignored by git; `--out docs/results` for the canonical set the docs quote) in the results format
of the design doc (bench, case, us, gbps, floor_us, pct_floor, baselines, gpu, commit, date) and
prints the same as an aligned table.
"""
