"""EngineCore: the busy loop's one step — schedule, execute, update."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from vllmpy import envs
from vllmpy.config import EngineConfig
from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request, RequestStatus
from vllmpy.core.sched_output import EngineCoreOutput
from vllmpy.core.scheduler import Scheduler
from vllmpy.loader.source import ModelSource
from vllmpy.sampling_params import SamplingParams
from vllmpy.worker.model_runner import ModelRunner


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request as the frontend hands it to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved by the frontend, >= 1
    arrival_time: float


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.model_runner.load_model(source)
        self.model_runner.initialize_kv_cache()
        self.kv_cache_manager = KVCacheManager(config.cache.num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
        )
        self.eos_token_ids = set(config.model.eos_token_ids)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=req.max_tokens,
            arrival_time=req.arrival_time,
        ))

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if envs.VT_ENGINE_STEP_LOG:
            print(f"vllmpy step: tokens={scheduler_output.total_num_scheduled_tokens} "
                  f"running={self.scheduler.num_running} waiting={self.scheduler.num_waiting} "
                  f"free_blocks={self.kv_cache_manager.num_free_blocks}", file=sys.stderr)
        return outputs
