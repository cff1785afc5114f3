"""dsv41_decode: DeepSeek-V4.1's attention decode step at small batch, with a readable reference.

The public API (README "Python API" shows it end to end):

    ModelConfig, ConfigError               config.py: a config.json (official or Hugging Face) or a preset
    load_checkpoint, Checkpoint,           weights.py: read and validate a checkpoint folder; write a
    CheckpointError, write_synthetic_checkpoint     synthetic one in the same layout
    DecodeState                            state.py: caches and requests; plan / advance a call's rows
    StepRows, CapacityError                rows.py: a call's rows as `plan` lays them out; the
                                           capacity error
    AttentionStack, AttentionLayer,        stack.py, layer.py: the generic path (prefill, any rows)
    CallContext
    DecodeStep, StepError                  decode/: the specialized decode step (`stack.decode_step`)
    TensorParallel                         parallel.py: a rank's place in a tensor-parallel group
    verify_trace, record_trace             testing/: golden traces

Names are imported on first use (torch and Triton load then, not at `import dsv41_decode`).
Layout: `config`, `formats`, `records`, `weights`, `rows`, `open_groups`, `state`, `reference/` (the numerical contract),
`layer`, `stack`, `decode/`, `ops/` (Triton kernels), `testing/`, `bench/`, `cli`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "config", "ConfigError": "config",
    "load_checkpoint": "weights", "Checkpoint": "weights", "CheckpointError": "weights",
    "write_synthetic_checkpoint": "weights",
    "DecodeState": "state", "StepRows": "rows", "CapacityError": "rows",
    "AttentionStack": "stack", "AttentionLayer": "layer", "CallContext": "layer",
    "DecodeStep": "decode.step", "StepError": "decode.step",
    "TensorParallel": "parallel",
    "verify_trace": "testing.trace", "record_trace": "testing.record",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsv41_decode' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
