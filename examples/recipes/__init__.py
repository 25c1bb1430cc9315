"""Custom-training recipes composed from trainbus plugins and hooks, not Trainer subclasses.

Where an HF script subclasses ``Trainer`` and overrides ``compute_loss`` / ``training_step``, trainbus
adds a ``Plugin`` that replaces the loss at ``Event.LOSS``, wraps the ``compute_loss`` hook, or does
extra work around ``Event.BACKWARD_END``. One module per recipe, each with a ``main()`` that trains a
tiny model on CPU in a few seconds on data made in code::

    python -m examples.recipes.distillation    # teacher -> student: KL on softened logits + hard labels
    python -m examples.recipes.multitask       # shared trunk, two heads, fixed or uncertainty weights
    python -m examples.recipes.contrastive     # CLIP-style symmetric InfoNCE with in-batch negatives
    python -m examples.recipes.adversarial     # FGM: perturb the embeddings, backward twice, restore

``tests/test_recipes.py`` checks that each learns and pins its mechanism.
"""
