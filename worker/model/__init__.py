"""Model families over a paged KV cache (registry.py maps config.json architectures to them; paged_attention.py
is their shared KV-cache attention), the checkpoint loader, tokenizer and the tiny default checkpoint."""
from disagg.worker.model.config import ModelConfig
from disagg.worker.model.llama import CausalLM
from disagg.worker.model.loader import load_model
from disagg.worker.model.tiny import write_tiny_checkpoint
from disagg.worker.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["CausalLM", "IncrementalDetokenizer", "ModelConfig", "Tokenizer", "load_model", "write_tiny_checkpoint"]
