"""POST /v1/embeddings (OpenAI's endpoint, with vLLM's extra fields)."""

from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    random_id,
)
from vllmpy.entrypoints.openai.serving_common import ServerContext
from vllmpy.entrypoints.openai.serving_pooling import (
    check_params,
    check_task,
    encode_vector,
    input_jobs,
    log_jobs,
    run_jobs,
    usage,
)


class EmbeddingHandler:
    """One vector per input, in input order; the usage counts every input's tokens."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def full(self, req: EmbeddingRequest) -> dict[str, Any]:
        self.ctx.check_model(req.model)
        check_task(self.ctx, "embed")
        params = req.to_pooling_params()
        check_params(self.ctx, params, req.priority)
        request_id = random_id("embd")
        jobs = input_jobs(self.ctx, req, params)
        log_jobs(self.ctx, request_id, "embedding", jobs)
        outs = await run_jobs(self.ctx, jobs, request_id, req.priority)
        data = [EmbeddingResponseData(index=i, embedding=encode_vector(out.outputs.data,
                                                                       req.encoding_format))
                for i, out in enumerate(outs)]
        return EmbeddingResponse(id=request_id, model=self.ctx.served_model_name, data=data,
                                 usage=usage(outs)).model_dump(mode="json")
