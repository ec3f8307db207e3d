"""HybridEngine: the TP/PP training model, the KV-cache generation engine and the actor's
training <-> generation cycle, built on :mod:`hybridflow_comm`."""
