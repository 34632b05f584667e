"""The worker: runs a step on the model.

Module map:
    model_runner      ModelRunner: applies a step's deltas, builds the flat batch, forward, sampling, draft verification
    input_batch       InputBatch: the persistent batch, one row per request, as host arrays
    logits_pipeline   LogitsPipeline: the logits processors in order, per-request state, greedy skipping
    sampler           Sampler: greedy argmax and seeded sampling from the processed logits
    graphs            DecodeGraphs: decode steps replayed from a backend's graphs
    kv_sizing         the model's context and the KV budget after a profiling forward pass
"""
