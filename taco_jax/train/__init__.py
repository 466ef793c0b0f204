"""GPT training: `python -m taco_jax.train --config=...` (`cli.train` picks the trainer):
the single-device loop (`loop.train`) or the 3D-parallel one (`taco_jax.train.trainer`)."""
