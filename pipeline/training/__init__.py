"""Synchronous data-parallel training on Horovod: examples, settings, learning-rate scaling,
metrics and the training loop."""
