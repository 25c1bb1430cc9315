"""What a run shows: the training logger, its sinks (JSONL, CSV, TensorBoard) and progress bars."""
