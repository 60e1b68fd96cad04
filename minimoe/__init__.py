"""minimoe: sparse MoE language models in a few readable files (Granite-MoE, GraniteMoeShared, OLMoE, FlexOlmo,
Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3, GLM-4.5, Llama-4, gpt-oss, MiniMax-M2, GLM-4.7-Flash, Mistral-Small-4,
DeepSeek-V3.2, GLM-5, Gemma-4, Granite-Swash, MiMo-V2-Flash, DeepSeek-V4, and
the hybrids Granite-4.0-H, Qwen3-Next, Qwen3.5-MoE, Kimi-Linear, LFM2-MoE and Nemotron-H: one record each in minimoe/core/decoder/families.py), with LoRA and token-error-supervised routing."""
from minimoe.core.decoder.generate import generate
from minimoe.core.adaptation.lora import add_lora, merge_lora, unmerge_lora
from minimoe.core.routing_methods.methods import METHODS, Method, set_router
from minimoe.core.token_mixers.mixers import KVCache
from minimoe.core.decoder.model import CausalLMOutput, MoEConfig, MoEForCausalLM
from minimoe.core.routing_methods.routing import Routing
from minimoe.core.adaptation.trainable import trainable_parameters
from minimoe.integrations.hf_export import export_merged, export_peft
from minimoe.loading.checkpoint import from_pretrained, save_pretrained
from minimoe.loading.tokenizer import load_tokenizer
from minimoe.runs.adapters import load_adapter, save_adapter
from minimoe.core.routing_methods.objectives import OBJECTIVES, Objective
from minimoe.runs.user_methods import register_method, register_objective

__all__ = ["from_pretrained", "load_tokenizer", "save_pretrained", "generate",
           "CausalLMOutput", "KVCache", "MoEConfig", "MoEForCausalLM", "Routing", "set_router",
           "Method", "METHODS", "register_method", "Objective", "OBJECTIVES", "register_objective",
           "add_lora", "merge_lora", "unmerge_lora", "save_adapter", "load_adapter", "export_merged",
           "trainable_parameters", "export_peft"]
