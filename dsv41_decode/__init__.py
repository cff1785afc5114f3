"""dsv41_decode: DeepSeek-V4.1's attention decode step at small batch, with a readable reference.

Layout: `config` (ModelConfig, LayerPlan), `formats` (number formats and cache records), `weights`
(checkpoints), `state` (caches and requests), `reference/` (the numerical contract), `layer`
(AttentionLayer), `stack` (layers + mHC boundaries), `testing/` (traces, comparisons), `cli`.
"""

__version__ = "0.1.0"
