"""Worker process: distributed init, persistent batch, model runner, sampler."""
