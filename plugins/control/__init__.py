"""Run control: when to log / evaluate / save (``FlowControl``), the best metric and early stopping."""
