"""The model runner: the only layer that touches tensors and devices - input preparation, the forward pass
inside the KV-connector step, sampling, and the KV cache's memory."""
