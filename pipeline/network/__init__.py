"""The FFN network: the model, its movement rule, device binding, the authors' released weights."""
