"""vllmpy: an LLM inference and serving engine on PyTorch and Triton."""

from vllmpy.config import EngineArgs
from vllmpy.outputs import CompletionOutput, RequestOutput
from vllmpy.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestOutputKind"]
__version__ = "0.1.0"


def __getattr__(name: str):  # LLM pulls in torch and the models: import it on first use
    if name == "LLM":
        from vllmpy.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'vllmpy' has no attribute {name!r}")
