"""Model-making: a dense model upcycled or split into experts, the default SmolLM2 model, tiny random models of every family, and a split model healed from its dense teacher."""
