"""The public gateway: llmesh.v1.InferenceService over the tokenizer, router and postprocessor tiers."""
