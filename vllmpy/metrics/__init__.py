"""Prometheus metrics with vLLM's ``vllm:*`` names, fed from the engine frontend."""

from vllmpy.metrics.prometheus import PrometheusStatLogger, build_1_2_5_buckets

__all__ = ["PrometheusStatLogger", "build_1_2_5_buckets"]
