"""Single-device GPT trainer: `train(config, workdir)`; CLI in `taco_jax.train.cli`."""
