"""POST /score and POST /rerank (vLLM's endpoints; /rerank in Jina's and Cohere's shape).

A model with a classification head (a cross-encoder) scores each text pair in one engine
request; an embedding model scores a pair by the cosine of the two texts' embeddings,
embedding each distinct text once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllmpy.engine.llm import score_pairs
from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    UsageInfo,
    random_id,
)
from vllmpy.entrypoints.openai.serving_common import ServerContext, check_prompt_bytes
from vllmpy.entrypoints.openai.serving_pooling import (
    PoolingJob,
    check_params,
    check_task,
    log_jobs,
    prompt_of,
    run_jobs,
)
from vllmpy.pooling import model_tasks


class ScoreHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def _scores(self, req: ScoreRequest | RerankRequest, request_id: str,
                      side_1: tuple[str, str | list[str]], side_2: tuple[str, str | list[str]]
                      ) -> tuple[list[float], int]:
        """(one score per pair of the two sides, paired by score_pairs' rule; the prompt
        tokens counted). A side is (its body field, its text or texts)."""
        self.ctx.check_model(req.model)
        check_task(self.ctx, "score")
        try:
            pairs = score_pairs(side_1[1], side_2[1])
        except ValueError as e:
            raise OpenAIError(400, str(e), param=side_2[0]) from None
        # the body field each pair's texts came from: text_2.3, or query for a single text
        fields = [tuple(name if isinstance(value, str) else f"{name}.{k}"
                        for name, value in (side_1, side_2)) for k in range(len(pairs))]
        if "classify" in model_tasks(self.ctx.engine.model_config):
            return await self._cross_encoder(req, request_id, pairs, fields)
        return await self._cosine(req, request_id, pairs, fields)

    async def _cross_encoder(self, req: ScoreRequest | RerankRequest, request_id: str,
                             pairs: list[tuple[str, str]], fields: list[tuple[str, ...]]
                             ) -> tuple[list[float], int]:
        params = req.to_pooling_params()
        check_params(self.ctx, params, req.priority)
        if params.truncate_prompt_tokens is None:  # the first texts are checked in prompt_of
            for (_, b), where in zip(pairs, fields):
                check_prompt_bytes(self.ctx, b, where[1])
        jobs = [PoolingJob(prompt_of(self.ctx, a, params, req.cache_salt, where[0]), params,
                           where[1], pair=b) for (a, b), where in zip(pairs, fields)]
        log_jobs(self.ctx, request_id, "score", jobs)
        outs = await run_jobs(self.ctx, jobs, request_id, req.priority)
        return ([float(out.outputs.data[0]) for out in outs],
                sum(len(out.prompt_token_ids) for out in outs))

    async def _cosine(self, req: ScoreRequest | RerankRequest, request_id: str,
                      pairs: list[tuple[str, str]], fields: list[tuple[str, ...]]
                      ) -> tuple[list[float], int]:
        embed = dataclasses.replace(req.to_pooling_params(), task="embed", use_activation=None)
        check_params(self.ctx, embed, req.priority)
        first_seen: dict[str, str] = {}  # each distinct text -> the field it first came from
        for pair, where in zip(pairs, fields):
            for text, field in zip(pair, where):
                first_seen.setdefault(text, field)
        texts = list(first_seen)
        jobs = [PoolingJob(prompt_of(self.ctx, t, embed, req.cache_salt, first_seen[t]), embed,
                           first_seen[t]) for t in texts]
        log_jobs(self.ctx, request_id, "score (cosine of embeddings)", jobs)
        outs = await run_jobs(self.ctx, jobs, request_id, req.priority)
        vectors = {t: out.outputs.data for t, out in zip(texts, outs)}
        scores = [float(torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0))
                  for a, b in pairs]
        return scores, sum(len(out.prompt_token_ids) for out in outs)

    async def score(self, req: ScoreRequest) -> dict[str, Any]:
        request_id = random_id("score")
        scores, tokens = await self._scores(req, request_id, ("text_1", req.text_1),
                                            ("text_2", req.text_2))
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=request_id, model=self.ctx.served_model_name, data=data,
                             usage=UsageInfo(prompt_tokens=tokens,
                                             total_tokens=tokens)).model_dump(mode="json")

    async def rerank(self, req: RerankRequest) -> dict[str, Any]:
        request_id = random_id("rerank")
        scores, tokens = await self._scores(req, request_id, ("query", req.query),
                                            ("documents", req.documents))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties by index
        if req.top_n > 0:
            order = order[:req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=(RerankDocument(text=req.documents[i])
                                          if req.return_documents else None))
                   for i in order]
        return RerankResponse(id=request_id, model=self.ctx.served_model_name,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=results).model_dump(mode="json")
