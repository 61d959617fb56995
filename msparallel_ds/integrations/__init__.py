"""Integrations with HF transformers, accelerate, the Trainer and the deepspeed launcher."""
