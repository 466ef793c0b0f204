"""GPT training on any (data, pipeline, tensor) mesh, one device included:
`python -m taco_jax.train --config=...` (`cli`), the trainer (`trainer.train`), its step
loop (`runner`), checkpoints, metrics, optimizer and config checks."""
