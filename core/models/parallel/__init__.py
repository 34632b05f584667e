"""How a model is split over ranks (docs/parallel.md); the ranks at run time are ``ember.parallel``.

Module map:
    state     ParallelConfig, ParallelContext (ranks, groups), init_parallel, torchrun's environment
    layers    column/row-parallel linears, vocabulary-parallel embedding, logits gather, checkpoint slices
    model     what an architecture calls: its parallel projections, its stage's shard, the stage forward
    pipeline  micro-batches (split at request boundaries) and the attention wrapper that prepares them
    loader    one rank's shard read from safetensors with get_slice
"""
