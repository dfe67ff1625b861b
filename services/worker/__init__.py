"""Inference worker tier: vLLM AsyncLLM behind ``llmesh.worker.v1.WorkerService``."""
