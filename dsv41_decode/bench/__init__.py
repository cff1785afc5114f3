"""Benchmarks (GPU): timing under CUDA graphs, the measured bandwidth floor, results files and plots.

Every benchmark writes one JSON object per case to `docs/results/<bench>-<gpu>.jsonl` in the
results format of the design doc (bench, case, us, gbps, floor_us, pct_floor, baselines, gpu,
commit, date) and prints the same as an aligned table.
"""
