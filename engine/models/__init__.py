"""Model classes by Hugging Face `model_type`."""

from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}

__all__ = ["MODEL_CLASSES", "LlamaForCausalLM"]
