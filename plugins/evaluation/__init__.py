"""Evaluation and prediction: the loss and prediction collector, gathering, ignite metrics, half-precision eval."""
