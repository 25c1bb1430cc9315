"""What shapes an optimizer step: optimizers, schedules, accumulation, clipping, precision, regularization."""
