"""Engine adapter tests (vLLM, SGLang): helpers live beside this file (``fake_vllm``, ``tiny_llama``)."""
