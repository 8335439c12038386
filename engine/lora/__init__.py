"""Multi-LoRA: PEFT adapters served on one base model, rows of several adapters in one step.

`adapter` reads one adapter from its PEFT folder; `resident` holds the adapters served, each in
a slot, and stacks their matrices per linear layer; `mapping` says which of a step's rows run
with which slot; `linear` adds each row's adapter delta to a linear layer's product.
"""
