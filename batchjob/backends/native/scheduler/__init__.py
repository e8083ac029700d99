"""Scheduling policies of the native engine (batchllm, baseline) and their shared base."""
