"""vllmpy: an LLM inference and serving engine on PyTorch and Triton."""

from vllmpy.config import EngineArgs
from vllmpy.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from vllmpy.pooling.params import PoolingParams
from vllmpy.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestOutputKind", "PoolingParams", "PoolingRequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the engines pull in torch and the models: import on first use
    if name == "LLM":
        from vllmpy.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from vllmpy.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'vllmpy' has no attribute {name!r}")
