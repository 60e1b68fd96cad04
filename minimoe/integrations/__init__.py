"""minimoe in other tools: lm-evaluation-harness and peft export."""
