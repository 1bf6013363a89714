"""Multi-LoRA serving: many PEFT adapters on one shared base model, batched in one
forward, paged between resident slots, host memory and disk (docs/lora.md)."""
