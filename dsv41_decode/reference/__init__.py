"""The numerical contract of DeepSeek-V4.1 attention, as readable PyTorch (spec: shared/spec/v41-attention.md).

One module per concern: `rope`, `linear` (FP8/BF16 linears, RMSNorm), `compressor`, `indexer`,
`attention` (sparse attention with the sink, output projection), `mhc` (the mHC boundary).
Everything here is pure math on explicit tensors, runs on the CPU, and computes each row
independently of how many rows it is given (batch-invariant), so that decode and prefill can be
compared bit for bit.
"""
