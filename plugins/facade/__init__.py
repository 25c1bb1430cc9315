"""The Hugging Face style facade: ``TrainingArguments`` composed into plugins on a ``Trainer``; HF callbacks."""
