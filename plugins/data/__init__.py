"""Data: collators, the seeded epoch sampler and resumable loaders (``ResumableData``)."""
