"""POST /classify (vLLM's endpoint): class probabilities and the top label per input."""

from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    random_id,
)
from vllmpy.entrypoints.openai.serving_common import ServerContext
from vllmpy.entrypoints.openai.serving_pooling import (
    check_params,
    check_task,
    input_jobs,
    log_jobs,
    run_jobs,
    usage,
)


def label_names(hf_config: dict[str, Any], num_labels: int) -> list[str]:
    """Each class's name: config.json's ``id2label`` (keys are the ids as strings), or
    transformers' default ``LABEL_i`` for an id it does not name."""
    named = {str(k): str(v) for k, v in (hf_config.get("id2label") or {}).items()}
    return [named.get(str(i), f"LABEL_{i}") for i in range(num_labels)]


class ClassifyHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def full(self, req: ClassificationRequest) -> dict[str, Any]:
        self.ctx.check_model(req.model)
        check_task(self.ctx, "classify")
        params = req.to_pooling_params()
        check_params(self.ctx, params, req.priority)
        request_id = random_id("classify")
        jobs = input_jobs(self.ctx, req, params)
        log_jobs(self.ctx, request_id, "classify", jobs)
        outs = await run_jobs(self.ctx, jobs, request_id, req.priority)
        names = label_names(self.ctx.engine.model_config.hf_config,
                            len(outs[0].outputs.data))
        data = []
        for i, out in enumerate(outs):
            probs = out.outputs.data.tolist()  # [num_labels]
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=names[best], probs=probs,
                                           num_classes=len(probs)))
        return ClassificationResponse(id=request_id, model=self.ctx.served_model_name,
                                      data=data, usage=usage(outs)).model_dump(mode="json")
