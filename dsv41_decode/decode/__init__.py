"""The specialized decode step (design: shared/design/specialized-decode.md).

`DecodeStep` (step.py) runs one decode step over every attention layer of an `AttentionStack`,
captured as one CUDA graph per row bucket; `AttentionStep` (attention.py) is one layer in the order
of design section 2; `StepMeta` (tables.py) the per-step metadata and tables; `Boundary`
(boundary.py) the fused mHC boundary; `Lanes` (lanes.py) the streams and events.
"""

from .attention import AttentionStep, NotEligible
from .step import DEFAULT_BUCKETS, DecodeStep, StepError

__all__ = ["AttentionStep", "DecodeStep", "NotEligible", "StepError", "DEFAULT_BUCKETS"]
