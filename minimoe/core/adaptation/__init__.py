"""What adapts a frozen base: LoRA, and the 4-bit packed base it trains over."""
