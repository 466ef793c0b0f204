"""`python -m taco_jax.train --config=<any config> [--config.key=value ...] [--workdir=...]
[--cpu_devices=N]`: the single-device or the 3D-parallel trainer, as the config needs."""
from taco_jax.train.cli import run

if __name__ == '__main__':
  run()
