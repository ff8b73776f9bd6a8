"""Engine adapters (Hugging Face transformers, vLLM, SGLang)."""
