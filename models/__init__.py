"""Models: a Flax NNX GPT built from injectable (dense or tensor-parallel) linear layers."""
