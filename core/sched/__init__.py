"""Scheduling: plain Python over plain data, tested without a model.

Module map:
    step              the step contract (a leaf): SchedulerOutput (NewRequest, CachedRequest,
                      drafts, allowed-token masks), ModelRunnerOutput, StepStats
    request           Request (slots dataclass), RequestStatus, and the admission checks
                      (priority, whether a request fits the KV pool)
    scheduler         Scheduler: admission, chunked prefill, preemption, drafts; emits the step as a value
    kv_cache_manager  BlockPool (reference counts, LRU free queue, prefix digests), KVCacheManager
"""
