"""The specialized decode step (design: shared/design/specialized-decode.md).

`DecodeStep` (step.py) runs one decode step over every attention layer of an `AttentionStack`,
captured as one CUDA graph per row bucket; `AttentionStep` (attention.py) is one layer in the order
of design section 2, in named phases; `StepMeta` (tables.py) the per-step metadata and tables;
`Scratch`, `IndexSelection`, `StepIO` (buffers.py) the step's buffers; `Boundary` (boundary.py)
the fused mHC boundary; `Lanes` and `StepEvents` (lanes.py) the streams and the events one step
carries between its layers.
"""

from .attention import AttentionStep, NotEligible
from .step import DEFAULT_BUCKETS, DecodeStep, StepError

__all__ = ["AttentionStep", "DecodeStep", "NotEligible", "StepError", "DEFAULT_BUCKETS"]
