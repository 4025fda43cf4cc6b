"""Integrations with other libraries (imported on demand: ``fa4dist.integrations.hf`` needs transformers)."""
