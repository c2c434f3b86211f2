"""Sampling: batched sampling parameters and the sampler that turns logits into token ids."""

from vllmpy.sample.metadata import SamplingMetadata
from vllmpy.sample.sampler import Sampler

__all__ = ["Sampler", "SamplingMetadata"]
