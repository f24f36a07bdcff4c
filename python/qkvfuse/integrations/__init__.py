"""Integrations of qkvfuse into other libraries' models. Each submodule imports its library only
when it is imported itself (`import qkvfuse` never imports them):

- qkvfuse.integrations.transformers: `apply_qkvfuse(model, fp8=False)` for Hugging Face
  transformers models (Qwen3, Qwen3-MoE, Gemma 3 text, Llama, Mistral); needs the optional
  dependency, `pip install --no-build-isolation .[transformers]`.
"""
