"""`python -m taco_jax.train --config=<any config> [--config.key=value ...] [--workdir=...]
[--cpu_devices=N]`: the trainer, on the mesh the config's parallel section asks for."""
from taco_jax.train.cli import run

if __name__ == '__main__':
  run()
