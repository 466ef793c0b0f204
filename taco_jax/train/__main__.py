"""`python -m taco_jax.train --config=configs/tiny.py [--config.key=value ...] [--workdir=...]`."""
from taco_jax.train.cli import run

if __name__ == '__main__':
  run()
