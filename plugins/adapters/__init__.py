"""Adapters through peft: switching the trained adapter at events, QLoRA preparation."""
